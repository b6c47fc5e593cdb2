"""The calibration objective: a causal LM's loss on a sequence's continuation, its plans decided from the prompt.

A sequence's first ``prompt_len`` tokens are its prompt: a per-request plan is decided from them (under
:func:`condcomp.plan_from_prompt`), as at inference, and only the tokens after it are scored. The static split's
gradient importance (:func:`condcomp.kv.importance.continuation_importance`) differentiates this loss;
``condcomp tune-llm`` reports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from condcomp.api import plan_from_prompt, routed_modules

__all__ = ["continuation_nll", "continuation_outputs", "prompt_plans", "token_nll"]


@contextlib.contextmanager
def prompt_plans(model: nn.Module, prompt_len: int) -> Iterator[None]:
    """``condcomp.plan_from_prompt(model, prompt_len)`` where the model has routed layers and condcomp has it."""
    if not routed_modules(model):
        yield
        return
    with plan_from_prompt(model, prompt_len):
        yield


def continuation_nll(model: nn.Module, ids: Tensor, prompt_len: int) -> Tensor:
    """Per-token negative log-likelihood ``(B, T - prompt_len)`` of tokens ``prompt_len .. T-1``.

    Only the logits that predict them are computed (``logits_to_keep``): the vocabulary projection of the prompt
    positions is skipped.
    """
    logits, _ = continuation_outputs(model, ids, prompt_len)
    return token_nll(logits, ids[:, prompt_len:])


def continuation_outputs(model: nn.Module, ids: Tensor, prompt_len: int, logits: bool = True,
                         hidden: bool = False) -> tuple[Tensor, Tensor | None]:
    """The model's outputs at the positions that predict the continuation tokens ``prompt_len .. T-1`` (positions
    ``prompt_len-1 .. T-2``): logits ``(B, T - P, V)``, at least float32, and with ``hidden`` the final hidden
    states there ``(B, T - P, D)`` (the input of the vocabulary projection), else None.

    The plan of a routed model is decided from the prompt (:func:`prompt_plans`). ``logits=False`` (only with
    ``hidden``) skips the vocabulary projection but one position, and returns an empty logits tensor.
    """
    B, T = ids.shape
    if not 0 < prompt_len < T:
        raise ValueError(f"prompt_len must be in [1, {T - 1}] for sequences of {T} tokens, got {prompt_len}")
    if not (logits or hidden):
        raise ValueError("continuation_outputs: ask for logits, hidden states or both")
    with prompt_plans(model, prompt_len):
        out = model(input_ids=ids, logits_to_keep=T - prompt_len + 1 if logits else 1, use_cache=False,
                    output_hidden_states=hidden)
    kept = out.logits[:, :-1] if logits else out.logits[:, :0]  # (B, T - P, V): positions P-1 .. T-2
    kept = kept.to(torch.promote_types(kept.dtype, torch.float32))  # half -> float32; float64 stays
    states = out.hidden_states[-1][:, prompt_len - 1:-1] if hidden else None  # (B, T - P, D), after the final norm
    return kept, states


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """``(B, n)`` negative log-likelihood of ``targets (B, n)`` under ``logits (B, n, V)``."""
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
