"""Stop a training run whose loss or parameters stopped being finite, naming the step and the settings to change.

A diverged run must not go on to write a result: the training loops of ``condcomp train``/``ablate``, ``tune-llm``
and ``calibrate-kv`` (both methods) call :func:`stop_if_diverged` after every optimiser step, before anything is
saved, so neither a checkpoint nor a record of a non-finite state is written. The command line prints the message
(exit status 2).

>>> import torch
>>> stop_if_diverged(3, {"loss": 0.5}, [torch.ones(2)], "--lr 0.001")
>>> stop_if_diverged(3, {"loss": float("nan")}, [torch.ones(2)], "--lr 1e+30")
Traceback (most recent call last):
...
condcomp.experiments.divergence.TrainingDiverged: training diverged at step 3 (loss nan): the run stops without \
writing a result. The settings it ran with: --lr 1e+30; run again with a smaller learning rate (or other settings)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor


class TrainingDiverged(RuntimeError):
    """A training step gave a non-finite loss or left a non-finite parameter."""


def flags(settings: Mapping[str, Any], *names: str) -> str:
    """``"--lr 0.02, --l1 0.05"``: the command-line flags of ``names`` set in ``settings`` (not None, not 0: a term
    switched off cannot make a run diverge), with their values."""
    return ", ".join(f"--{n.replace('_', '-')} {settings[n]:g}" for n in names if settings.get(n))


def stop_if_diverged(step: int, losses: Mapping[str, float], params: Iterable[Tensor], change: str) -> None:
    """Raise :class:`TrainingDiverged` when a value of ``losses`` or an element of ``params`` (after the update) is
    not finite. ``step``: the step just taken, counted from 1; ``change``: the settings that can make it diverge,
    as :func:`flags` writes them."""
    bad = {k: v for k, v in losses.items() if not math.isfinite(v)}
    tensors = [p.detach() for p in params]
    finite = bool(torch.stack([torch.isfinite(p).all() for p in tensors]).all()) if tensors else True
    if not bad and finite:
        return
    what = ", ".join(f"{k} {v}" for k, v in bad.items()) or "a parameter is not finite after the update"
    raise TrainingDiverged(f"training diverged at step {step} ({what}): the run stops without writing a result. "
                           f"The settings it ran with: {change}; run again with a smaller learning rate (or other "
                           "settings)")
