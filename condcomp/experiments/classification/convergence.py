"""Has a run's training loss stopped falling? The convergence signal of ``condcomp train`` / ``ablate``.

The mean training loss over the last fifth of the steps is compared with the fifth before it. The run counts
as converged when the drop is below ``tolerance`` (relative), below ``absolute_tolerance`` (a loss near zero),
or within the batch-to-batch noise (two standard errors of the difference); a run too short for two windows of
``min_window_steps`` steps cannot tell. Either way it is recorded in ``metrics.json``
(``train.convergence``), and a run that did not converge, or cannot tell, prints a warning that says what to
change.

>>> check = PlateauCheck()
>>> check.verdict([2.0 - 0.01 * i for i in range(100)])["plateaued"]
False
>>> check.verdict([1.0, 1.1] * 50)["plateaued"]
True
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlateauCheck:
    """Compares the mean loss of the last ``window`` fraction of the steps with the same number before it."""

    window: float = 0.2
    min_window_steps: int = 10
    tolerance: float = 0.02  # a relative drop below this is a plateau
    absolute_tolerance: float = 0.05  # and so is a drop below this (nats): a loss near 0 halving is not learning

    def verdict(self, losses: Sequence[float]) -> dict[str, Any]:
        """``plateaued``: True, False, or None (too few steps to tell), with the two window means."""
        n = len(losses)
        w = max(self.min_window_steps, int(n * self.window))
        out: dict[str, Any] = {"steps": n, "window_steps": w, "tolerance": self.tolerance,
                               "absolute_tolerance": self.absolute_tolerance}
        if n < 2 * w:
            return {**out, "plateaued": None}
        earlier, last = losses[n - 2 * w:n - w], losses[n - w:]
        a, b = statistics.fmean(earlier), statistics.fmean(last)
        noise = 2 * math.sqrt((statistics.variance(earlier) + statistics.variance(last)) / w)
        drop = a - b
        still_falling = drop > max(self.tolerance * abs(a), self.absolute_tolerance, noise)
        return {**out, "plateaued": not still_falling, "earlier_loss": a, "last_loss": b,
                "relative_drop": drop / abs(a) if a else 0.0}


def warning(verdict: dict[str, Any], epochs_run: float, name: str) -> str | None:
    """The line to print when the run has not converged (or cannot tell); None when it has."""
    how = ("train longer: raise --epochs (or --max-steps, or drop it); docs/cli.md, 'How long to train', says "
           "how to choose")
    if verdict["plateaued"] is None:
        return (f"warning: {name}: {verdict['steps']} training steps are too few to tell whether the loss has "
                f"stopped falling (two windows of {verdict['window_steps']} steps needed); {how}")
    if verdict["plateaued"]:
        return None
    return (f"warning: {name}: the training loss was still falling at the end ({verdict['earlier_loss']:.3f} -> "
            f"{verdict['last_loss']:.3f} over the last {verdict['window_steps']} of {verdict['steps']} steps, "
            f"{epochs_run:.3g} epochs): the model has not converged, and its accuracy and budget are not final; "
            f"{how}")
