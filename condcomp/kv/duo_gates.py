"""Train DuoAttention gates on a frozen causal LM, save them, and cut them to a byte budget.

Training (Xiao et al., ICLR 2025): every gate starts at 1 (full attention); each step runs the dense model and the
gated model (:mod:`condcomp.kv.duo_attention`) on the same long retrieval text and minimises

    loss = mean over tokens of mean_d (h_gated - h_dense)^2  +  lambda * mean(alpha)

with ``h`` the last layer's hidden states (after the final norm), by Adam on the gates alone, each gate projected
back into [0, 1] after the step. Tokens within the first ``sinks + window`` positions see the same keys under both
patterns, so only later tokens carry a gradient: sequences must be longer than the window. The L1 price pushes
every gate down; the distillation term holds up the gates of groups whose streaming costs the most.

Thresholding (:func:`split_from_scores`): keep in full the highest gates over the whole model (as DuoAttention,
so layers may keep different numbers of groups) until the kept fraction of all (layer, group) pairs equals the
budget; every other group streams.

The calibration text is the caller's (``condcomp calibrate-kv`` uses passkey prompts followed by their answer,
:func:`condcomp.experiments.llm.duo_gates.calibration_rows`, so retrieving the key from far back is part of what
the gated model must reproduce). The public entry points are re-exported by :mod:`condcomp.kv.calibration`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.experiments.divergence import flags, stop_if_diverged
from condcomp.kv.duo_attention import DuoGates, attention_modules, gated

FORMAT = "condcomp-kv-gates/1"
HISTORY_EVERY = 5  # steps between the recorded (step, distill, mean gate) points
ROW_KINDS = ("passkey", "mix")  # the calibration text a run names in its settings


@dataclass(frozen=True)
class DuoSettings:
    """One gate training run. ``l1``: lambda, the price per unit of mean gate; ``lr``: Adam's (DuoAttention's);
    ``rows``: the calibration text it was given (``passkey``: pass-key prompts; ``mix``: ``calibrate-kv --mix``'s
    facts, quotes and plain text), recorded with the gates and checked on resume."""

    steps: int = 100
    seq_len: int = 1024
    lr: float = 0.02
    l1: float = 0.05
    sinks: int = 4
    window: int = 252
    seed: int = 0
    rows: str = "passkey"

    def check(self) -> None:
        if self.rows not in ROW_KINDS:
            raise ValueError(f"unknown calibration rows {self.rows!r}; choose from {', '.join(ROW_KINDS)}")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.seq_len <= self.sinks + self.window:
            raise ValueError(f"--seq-len {self.seq_len} must exceed sinks + window = {self.sinks + self.window}: "
                             "shorter sequences attend identically under both patterns and train nothing")
        if self.lr <= 0 or self.l1 < 0:
            raise ValueError(f"--lr must be > 0 and --l1 >= 0, got lr={self.lr}, l1={self.l1}")


def distill_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean over tokens and coordinates of ``(student - teacher)^2``; both ``(B, T, D)``."""
    return (student.float() - teacher.float()).pow(2).mean()


def hidden_states(model: nn.Module, ids: Tensor) -> Tensor:
    """``(B, T, D)`` the last layer's hidden states (after the final norm; no language-model head)."""
    base = getattr(model, "base_model", model)
    return base(input_ids=ids, use_cache=False).last_hidden_state  # type: ignore[no-any-return]


def train_step(model: nn.Module, gates: DuoGates, opt: torch.optim.Optimizer, ids: Tensor,
               l1: float) -> tuple[float, float]:
    """One step on ``ids (B, T)``: ``(distillation loss, mean gate)`` before the step."""
    with torch.no_grad():
        teacher = hidden_states(model, ids)
    with gated(model, gates):
        student = hidden_states(model, ids)
    distill = distill_loss(student, teacher)
    price = gates.alpha.mean()
    opt.zero_grad(set_to_none=True)
    (distill + l1 * price).backward()
    opt.step()
    gates.clamp_()
    return float(distill.detach()), float(price.detach())


def train_gates(model: nn.Module, rows: Sequence[Sequence[int]], settings: DuoSettings,
                checkpoint: Path | None = None, on_step: Callable[[int, float, float], None] | None = None
                ) -> tuple[DuoGates, list[list[float]]]:
    """Gates ``(L, G)`` trained for ``settings.steps`` steps, one row per step (cycling through ``rows``), and the
    history ``[step, distillation, mean gate]``. The model's parameters are frozen during training and given back
    as they were. ``checkpoint``: a file the state is saved to every 10 steps and resumed from (same settings but
    the number of steps, which may grow, or shrink to the saved step)."""
    settings.check()
    cfg: Any = getattr(model, "config")  # noqa: B009
    L, G = len(attention_modules(model)), int(getattr(cfg, "num_key_value_heads", 0) or cfg.num_attention_heads)
    torch.manual_seed(settings.seed)
    device = next(model.parameters()).device
    gates = DuoGates(L, G, settings.sinks, settings.window).to(device)
    opt = torch.optim.Adam(gates.parameters(), lr=settings.lr)
    history = train_loop(model, gates, opt, rows, asdict(settings),
                         lambda step, ids: train_step(model, gates, opt, ids, settings.l1), checkpoint, on_step)
    return gates, history


StepFn = Callable[[int, Tensor], tuple[float, float]]  # (step, ids (1, T)) -> (distillation, a second number)


def train_loop(model: nn.Module, trainable: nn.Module, opt: torch.optim.Optimizer, rows: Sequence[Sequence[int]],
               settings: dict[str, Any], step_fn: StepFn, checkpoint: Path | None = None,
               on_step: Callable[[int, float, float], None] | None = None,
               command: str = "calibrate-kv --method duo") -> list[list[float]]:
    """Run ``step_fn`` for steps ``0 .. settings["steps"] - 1`` on one row each (cycling through ``rows``) with the
    model's parameters frozen; the history ``[step, distillation, second number]`` every few steps. ``checkpoint``:
    ``trainable``'s and ``opt``'s state, the history and every random generator (:mod:`condcomp.resume`) are
    saved there every 10 steps and resumed from, so a resumed run ends as the uninterrupted one; a checkpoint of
    other settings (but the number of steps, which may grow, or shrink to the saved step), of another ``command``
    or of another model (:func:`condcomp.resume.model_identity`, weights' first values included) is refused."""
    from condcomp.resume import ResumeError, ResumeFile, model_identity, restore_rng

    steps = int(settings["steps"])
    device = next(model.parameters()).device
    history: list[list[float]] = []
    start = 0
    # A run may be extended, or cut at a saved step; every other setting must match. (A run whose schedules
    # depend on the number of steps puts what they depend on in its settings too.)
    saved = (ResumeFile(checkpoint, settings, may_differ=("steps",),
                        owner={"command": command, **model_identity(model, values=True)})
             if checkpoint is not None else None)
    state = saved.load() if saved is not None else None
    if saved is not None and state is not None:
        if int(state["step"]) > steps:
            raise ResumeError(f"{checkpoint} is at step {state['step']}, past this run's --steps {steps}: ask for "
                              f"at least {state['step']} steps, or delete it to start over")
        saved.check_tensors("the trained state", state.get("trainable"), trainable.state_dict())
        trainable.load_state_dict(state["trainable"])
        try:
            opt.load_state_dict(state["opt"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:  # the shapes matched: a malformed file
            raise ResumeError(f"{checkpoint}: the optimiser state does not fit this run ({type(err).__name__}: "
                              f"{err}); delete it to start over") from err
        start = int(state["step"])
        # an extended run drops the shorter run's last point when it is off the grid (as a run of `steps` would)
        history = [list(h) for h in state["history"] if int(h[0]) % HISTORY_EVERY == 0 or int(h[0]) == steps - 1]
        restore_rng(state["rng"])  # last: the noisy routers draw the next step's noise from it
    requires = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for step in range(start, steps):
            ids = torch.tensor([list(rows[step % len(rows)])], device=device)  # (1, T)
            first, second = step_fn(step, ids)
            stop_if_diverged(step + 1, {"distillation": first, "second number": second}, trainable.parameters(),
                             flags(settings, "lr", "l1"))
            if step % HISTORY_EVERY == 0 or step == steps - 1:
                history.append([float(step), first, second])
            if on_step is not None:
                on_step(step, first, second)
            if saved is not None and ((step + 1) % 10 == 0 or step + 1 == steps):
                saved.save({"trainable": trainable.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                            "history": history})
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(requires[n])
    return history


def split_from_scores(scores: Tensor, fraction: float) -> list[list[int]]:
    """Per layer, the groups kept in full: the ``round(fraction * L * G)`` highest scores over all layers
    (ties: the earlier layer, then the lower group), each layer's most important first.

    >>> split_from_scores(torch.tensor([[0.9, 0.1], [0.5, 0.7]]), 0.5)
    [[0], [1]]
    >>> split_from_scores(torch.tensor([[0.9, 0.8], [0.5, 0.7]]), 0.5)
    [[0, 1], []]
    """
    if scores.dim() != 2:
        raise ValueError(f"gate scores must be (layers, KV groups), got shape {tuple(scores.shape)}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the kept fraction must be in [0, 1], got {fraction}")
    L, G = scores.shape
    n = round(fraction * L * G)
    flat = scores.double().flatten().tolist()
    chosen = sorted(range(L * G), key=lambda i: (-flat[i], i))[:n]
    kept: list[list[int]] = [[] for _ in range(L)]
    for i in chosen:  # in order of decreasing score: each layer's list is already most important first
        kept[i // G].append(i % G)
    return kept


def save_gates(path: str | Path, method: str, model_name: str, scores: Tensor, sinks: int, window: int,
               settings: dict[str, Any], history: list[list[float]] | None = None) -> None:
    """Write a gates file: ``scores (L, G)`` (higher = keep in full) with how they were made."""
    path = Path(path)
    record = {"format": FORMAT, "method": method, "model": model_name, "layers": int(scores.shape[0]),
              "kv_groups": int(scores.shape[1]), "sinks": sinks, "window": window, "settings": settings,
              "scores": [[round(float(v), 6) for v in row] for row in scores], "history": history or []}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def load_gates(path: str | Path, layers: int, groups: int) -> dict[str, Any]:
    """A gates file's record (``scores (L, G)`` float64, ``sinks``, ``window``, how it was made), checked against
    the model's ``layers x groups``; a :class:`condcomp.files.FileError` naming the file, what was expected and what
    was found when it cannot be used (:mod:`condcomp.files`). A string path works too."""
    from condcomp.files import FileError, float_matrix, int_field, read_json_object

    path = Path(path)
    hint = (f"write it again with `condcomp calibrate-kv --method duo --out {path}` (docs/kv.md, 'a trained static "
            "split')")
    record = read_json_object(path, "a condcomp KV gates file", hint)
    if record.get("format") != FORMAT:
        raise FileError(f"{path} is not a condcomp KV gates file (format {record.get('format')!r}, expected "
                        f"{FORMAT!r}); {hint}")
    if "scores" not in record or record["scores"] is None:
        raise FileError(f"{path}: field 'scores' is {'null' if 'scores' in record else 'missing'} (a gates file holds "
                        f"scores (layers, KV groups)); {hint}")
    scores = float_matrix(record["scores"], path, "scores", f"calibrate gates for this model: {hint}",
                          shape=(layers, groups))
    for name, low in (("sinks", 0), ("window", 1)):  # int("3"), int(3.7) and True would pass silently
        int_field(record, name, path, f"the streaming pattern the gates were trained for; {hint}", low)
    record["scores"] = scores
    return record
