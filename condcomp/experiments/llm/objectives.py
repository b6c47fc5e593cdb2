"""The tuning objectives of ``condcomp tune-llm``: what the loss on the continuation tokens compares the tuned
variant with (``--objective``; docs/tuning.md, "Distillation as the tuning objective").

- ``lm`` (default): the language-modelling loss, the next-token negative log-likelihood of the text.
- ``kl``: ``tau^2 KL(teacher || student)`` between the next-token distributions at temperature ``tau``
  (``--kl-temperature``), per continuation token. The ``tau^2`` keeps the gradient's size comparable across
  temperatures (Hinton, Vinyals & Dean 2015).
- ``hidden``: the mean squared error between the final hidden states (after the final norm: the input of the
  vocabulary projection), averaged over the hidden dimension, per continuation token.
- ``lm+kl``: ``(1 - w) lm + w kl`` with ``w = --kl-weight``.

The teacher is the dense model the variants were copied from (``tuning_study``'s ``dense``): it is never wrapped
and never given adapters, runs in eval mode without gradients, and so is the loaded model itself at no memory
cost. PEFT's ``disable_adapter()`` with routing off would give the same model only for ``--tune lora``:
``--tune attention`` changes the projections themselves.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from condcomp.experiments.llm.evaluation import continuation_outputs, token_nll

OBJECTIVES = ("lm", "kl", "hidden", "lm+kl")
DEFAULT_TEMPERATURE = 1.0
DEFAULT_KL_WEIGHT = 0.5
OPTION_FIELDS = ("objective", "kl_temperature", "kl_weight")  # TuneSettings' fields for the objective


def check_objective(objective: str, temperature: float, weight: float) -> None:
    """Raise ValueError, saying what to use instead, for an unknown objective or an option out of range."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not 0 < temperature < math.inf:
        raise ValueError(f"kl_temperature must be positive (1: the model's own distributions), got {temperature}")
    if not 0 <= weight <= 1:
        raise ValueError(f"kl_weight must be in [0, 1] (the kl share of lm+kl's loss), got {weight}")


def needs_teacher(objective: str) -> bool:
    return objective != "lm"


def objective_key(objective: str, temperature: float, weight: float) -> dict[str, Any]:
    """The objective's options that shape the tuning, as a checkpoint records them: none for ``lm`` (so checkpoints
    and records written before objectives existed still match), the temperature for ``kl``, and the weight too
    for ``lm+kl``.

    >>> objective_key("lm", 2.0, 0.5), objective_key("kl", 2.0, 0.5)
    ({}, {'objective': 'kl', 'kl_temperature': 2.0})
    """
    key: dict[str, Any] = {}
    if objective != "lm":
        key["objective"] = objective
    if objective in ("kl", "lm+kl"):
        key["kl_temperature"] = temperature
    if objective == "lm+kl":
        key["kl_weight"] = weight
    return key


def settings_without_unused_options(settings: dict[str, Any]) -> dict[str, Any]:
    """A settings dict with the objective's options reduced to :func:`objective_key` (records compare equal when
    they differ only in an option their objective does not use)."""
    rest = {k: v for k, v in settings.items() if k not in OPTION_FIELDS}
    return rest | objective_key(settings.get("objective", "lm"),
                                settings.get("kl_temperature", DEFAULT_TEMPERATURE),
                                settings.get("kl_weight", DEFAULT_KL_WEIGHT))


def kl_per_token(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``(B, n)``: ``KL(p_teacher || p_student)`` per position of ``(B, n, V)`` logits, both softened by
    ``temperature`` (not scaled by ``tau^2``: :func:`objective_loss` does that)."""
    student = F.log_softmax(student_logits / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    return F.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)


def objective_loss(model: nn.Module, teacher: nn.Module | None, ids: Tensor, prompt_len: int, objective: str,
                   temperature: float = DEFAULT_TEMPERATURE,
                   weight: float = DEFAULT_KL_WEIGHT) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss to minimise on ``ids (B, T)`` (mean over continuation tokens) and its parts as floats for
    the history: ``nll`` (the student's language-model loss, whenever its logits are computed), ``kl``,
    ``hidden_mse``."""
    check_objective(objective, temperature, weight)
    if needs_teacher(objective) and teacher is None:
        raise ValueError(f"the {objective} objective needs the teacher (the dense model as loaded)")
    if teacher is model:
        raise ValueError("the teacher must be the untouched dense model, not the model being tuned")
    hidden = objective == "hidden"
    logits, states = continuation_outputs(model, ids, prompt_len, logits=not hidden, hidden=hidden)
    parts: dict[str, Tensor] = {}
    if not hidden:
        parts["nll"] = token_nll(logits, ids[:, prompt_len:]).mean()
    if needs_teacher(objective):
        assert teacher is not None
        teacher.eval()
        with torch.no_grad():
            t_logits, t_states = continuation_outputs(teacher, ids, prompt_len, logits=not hidden, hidden=hidden)
        if hidden:
            assert states is not None and t_states is not None
            parts["hidden_mse"] = (states - t_states).pow(2).mean()
        else:
            parts["kl"] = temperature ** 2 * kl_per_token(logits, t_logits, temperature).mean()
    loss = {"lm": lambda: parts["nll"], "kl": lambda: parts["kl"], "hidden": lambda: parts["hidden_mse"],
            "lm+kl": lambda: (1 - weight) * parts["nll"] + weight * parts["kl"]}[objective]()
    return loss, {k: float(v.detach()) for k, v in parts.items()}
