"""The budget rule and the constructors of HeadPlan that every router shares."""

from __future__ import annotations

import math
import struct
from typing import Literal

import torch
from torch import Tensor

from condcomp.types import HeadPlan

Rounding = Literal["floor", "ceil", "round"]
GateMode = Literal["binary", "weighted", "renormalized"]

# s * H computed in float can land a hair off an integer (0.3 * 10 = 3.0000000000000004, and a float32 s = 31/56
# times 112 heads is 61.99999...); the budget rule must not turn that into an extra or a missing head. The slack is
# per head: a float32 s is off by up to 6e-8 of itself, so s * H by up to 6e-8 * H.
_ROUNDING_SLACK = 1e-6


def kv_groups_used(active: Tensor, num_kv_heads: int) -> Tensor:
    """``(..., H)`` bool -> ``(..., Hkv)`` bool: the key/value heads (GQA groups) some active query head reads.

    Query head ``h`` reads key/value head ``h // (H / Hkv)``, so a group is used when any of its query heads is
    active. Pass a sequence plan's ``active (B, H)``, or a token plan's ``(B, T, H)`` (per token) or
    ``.any(1)`` of it (per example: a later token may read any group some token chose).

    >>> kv_groups_used(torch.tensor([[True, False, False, False, False, True]]), 3).tolist()
    [[True, False, True]]
    """
    H = active.shape[-1]
    if num_kv_heads < 1 or H % num_kv_heads:
        raise ValueError(f"{H} query heads do not split into {num_kv_heads} key/value groups")
    return active.unflatten(-1, (num_kv_heads, H // num_kv_heads)).any(-1)


def budget_k(s: Tensor, num_heads: int, k_min: int = 1, rounding: Rounding = "floor") -> Tensor:
    """The decided budget rule: ``k = clamp(floor(s * H), k_min, H)`` (int64, same shape as ``s``).

    >>> budget_k(torch.tensor([0.085, 0.5, 1.0]), 8).tolist()
    [1, 4, 8]
    >>> budget_k(torch.tensor([0.0]), 8, k_min=0).tolist()
    [0]
    """
    if not 0 <= k_min <= num_heads:
        raise ValueError(f"k_min must be in [0, num_heads={num_heads}], got {k_min}")
    # A NaN budget (non-finite input) would reach .long(), whose result is platform-defined; it means k_min.
    raw = torch.nan_to_num(s.detach().float(), nan=0.0) * num_heads
    slack = _ROUNDING_SLACK * max(num_heads, 1)
    if rounding == "floor":
        k = torch.floor(raw + slack)
    elif rounding == "ceil":
        k = torch.ceil(raw - slack)
    elif rounding == "round":
        k = torch.round(raw)
    else:
        raise ValueError(f"rounding must be 'floor', 'ceil' or 'round', got {rounding!r}")
    return k.clamp(k_min, num_heads).long()


def _float32(v: float) -> float:
    return float(struct.unpack("f", struct.pack("f", v))[0])


def budget_k_bound(s: float, num_heads: int, k_min: int = 1, rounding: Rounding = "floor") -> int:
    """:func:`budget_k` of one Python number, on the host: what ``budget_k`` gives a float32 tensor holding ``s``
    (the same float32 rounding and slack). Policies declare their ``Budget.k_cap`` with it without a device read.

    >>> budget_k_bound(0.25, 8), budget_k_bound(0.3, 10), budget_k_bound(0.0, 8)
    (2, 3, 1)
    """
    if not 0 <= k_min <= num_heads:
        raise ValueError(f"k_min must be in [0, num_heads={num_heads}], got {k_min}")
    s32 = 0.0 if math.isnan(s) else _float32(float(s))
    raw = _float32(s32 * num_heads)  # a float32 product of float32 s and an exact H, as the tensor rule computes it
    slack = _float32(_ROUNDING_SLACK * max(num_heads, 1))
    if rounding == "floor":
        k = math.floor(_float32(raw + slack))
    elif rounding == "ceil":
        k = math.ceil(_float32(raw - slack))
    elif rounding == "round":
        k = round(raw)  # round half to even, as torch.round
    else:
        raise ValueError(f"rounding must be 'floor', 'ceil' or 'round', got {rounding!r}")
    return min(max(int(k), k_min), num_heads)


def plan_from_active(
    active: Tensor,
    gates: Tensor | None = None,
    aux_losses: dict[str, Tensor] | None = None,
    k_cap: int | None = None,
    shared_heads: int = 0,
) -> HeadPlan:
    """A HeadPlan from a bool selection ``(B, H)`` (sequence) or ``(B, T, H)`` (token) and optional gates.

    Gates of inactive heads are forced to zero with no gradient, so every executor, whether it computes an
    inactive head or skips it, gives the same outputs and gradients. ``k_cap``: a bound on the active heads of
    every row known before the call (``HeadPlan.k_cap``; the caller guarantees it), None for H. ``shared_heads``:
    token plans, the first heads every real token chooses (``HeadPlan.shared_heads``, MoH's shared heads).

    >>> p = plan_from_active(torch.tensor([[True, False, True]]))
    >>> p.counts.tolist(), p.order.tolist()
    ([2], [[0, 2, 1]])
    """
    if active.dtype != torch.bool:
        raise TypeError(f"active must be a bool tensor, got {active.dtype}")
    if active.dim() not in (2, 3):
        raise ValueError(f"active must be (B, H) or (B, T, H), got shape {tuple(active.shape)}")
    H = active.shape[-1]
    if gates is None:
        gates = active.float()
    elif gates.shape != active.shape:
        raise ValueError(f"gates {tuple(gates.shape)} and active {tuple(active.shape)} must have the same shape")
    gates = gates.masked_fill(~active, 0.0)
    heads = torch.arange(H, device=active.device)
    order = torch.argsort((~active).long() * H + heads, dim=-1)  # active heads first, each group ascending
    return HeadPlan(
        granularity="sequence" if active.dim() == 2 else "token",
        gates=gates,
        active=active,
        counts=active.sum(-1),
        order=order,
        aux_losses=dict(aux_losses or {}),
        k_cap=k_cap,
        shared_heads=shared_heads,
    )


def top_k_mask(scores: Tensor, k: Tensor | int) -> Tensor:
    """Bool mask of the ``k`` highest scores along the last dim; ``k`` may vary per row (ties: lower index)."""
    H = scores.shape[-1]
    if isinstance(k, int):
        k = torch.full(scores.shape[:-1], k, device=scores.device, dtype=torch.long)
    if k.shape != scores.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} must match the score rows {tuple(scores.shape[:-1])}")
    best_first = torch.argsort(scores.detach(), dim=-1, descending=True, stable=True)
    keep = torch.arange(H, device=scores.device) < k.clamp(0, H).unsqueeze(-1)  # by rank: the first k
    # one scatter instead of a second argsort for the ranks: 0.05-0.35 ms less per call on (16, 256, 6) scores
    return torch.zeros_like(keep).scatter_(-1, best_first, keep)


def plan_top_k(
    scores: Tensor,
    k: Tensor | int,
    gates: GateMode = "binary",
    straight_through: bool = False,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    aux_losses: dict[str, Tensor] | None = None,
    k_cap: int | None = None,
) -> HeadPlan:
    """Keep the ``k`` best-scoring heads of each row.

    ``scores``: ``(B, H)`` for one head set per example or ``(B, T, H)`` per token; ``k``: int or ``(B,)`` /
    ``(B, T)``. ``gates``: ``"binary"`` (1 for selected heads), ``"weighted"`` (the softmax probability of
    ``scores / temperature``) or ``"renormalized"`` (that probability renormalised over the selected heads and
    scaled by their count, so uniform scores give gates of 1). ``straight_through`` makes binary gates carry
    the softmax's gradient (value 1, gradient of the probability). ``mask (B, T)`` (token scores only): padding
    tokens get no heads. ``k_cap``: a bound on ``k`` known before the call (``Budget.k_cap``), kept in the plan
    (``HeadPlan.k_cap``) so the gathered executor can size its capturable path without reading the plan; ``k`` is
    clamped to it (a no-op for a policy that keeps its own bound).

    >>> p = plan_top_k(torch.tensor([[0.1, 3.0, 2.0, -1.0]]), 2)
    >>> p.active.tolist()
    [[False, True, True, False]]
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if k_cap is not None:
        k = min(k, k_cap) if isinstance(k, int) else k.clamp(max=k_cap)
    active = top_k_mask(scores, k)
    if mask is not None:
        if scores.dim() != 3:
            raise ValueError("mask applies to per-token scores (B, T, H) only")
        active = active & mask.bool().unsqueeze(-1)
    probs = torch.softmax(scores.float() / temperature, dim=-1)
    if gates == "binary":
        g = active.float()
        if straight_through:
            g = g + (probs - probs.detach())  # parenthesised: the value stays exactly 0/1
    elif gates == "weighted":
        g = probs
    elif gates == "renormalized":
        kept = probs.masked_fill(~active, 0.0)
        g = kept / kept.sum(-1, keepdim=True).clamp_min(1e-9) * active.sum(-1, keepdim=True)
    else:
        raise ValueError(f"gates must be 'binary', 'weighted' or 'renormalized', got {gates!r}")
    return plan_from_active(active, g, aux_losses, k_cap)


def full_plan(batch: int, num_heads: int, device: torch.device, tokens: int | None = None) -> HeadPlan:
    """Every head active with gate 1: the plan that must reproduce the unwrapped module."""
    shape = (batch, num_heads) if tokens is None else (batch, tokens, num_heads)
    return plan_from_active(torch.ones(shape, dtype=torch.bool, device=device))
