"""Analytic FLOP counts of dense attention and of a plan (multiply-add = 2 FLOPs)."""

from __future__ import annotations

from torch import Tensor, nn

from condcomp.plans import kv_groups_used
from condcomp.types import HeadLayout, HeadPlan


def dense_flops(layout: HeadLayout, T: int, S: int) -> float:
    """FLOPs of one example through the dense block: projections, scores, attention x values, output."""
    D, H, Hkv, Dh = layout.d_model, layout.num_heads, layout.num_kv_heads, layout.head_dim
    Dk, Dv = layout.kdim or D, layout.vdim or layout.kdim or D
    projections = 2 * T * D * H * Dh + 2 * S * (Dk + Dv) * Hkv * Dh + 2 * T * H * Dh * D
    attention = 4 * T * S * H * Dh
    return float(projections + attention)


def plan_flops(layout: HeadLayout, plan: HeadPlan, T: int, S: int) -> Tensor:
    """FLOPs per example ``(B,)`` that the plan requires when only its active heads are computed.

    Sequence plans skip the query, key/value, score, value and output work of unselected heads (a key/value
    head is computed if any of its query heads is active). Token plans compute queries, attention rows and
    output per selected (token, head) pair, and keys/values for every head some token of the sequence chose.
    """
    D, Hkv, Dh = layout.d_model, layout.num_kv_heads, layout.head_dim
    Dk, Dv = layout.kdim or D, layout.vdim or layout.kdim or D
    active = plan.active
    if plan.granularity == "sequence":
        pairs = plan.counts.double() * T  # (B,) query rows computed
        heads_any = active  # (B, H)
    else:
        pairs = plan.counts.double().sum(-1)  # (B,)
        heads_any = active.any(1)  # (B, H)
    kv_used = kv_groups_used(heads_any, Hkv).sum(-1).double()  # (B,)
    per_pair = 2 * D * Dh + 4 * S * Dh + 2 * Dh * D
    return pairs * per_pair + kv_used * 2 * S * (Dk + Dv) * Dh


def routing_flops(component: object, T: int) -> float:
    """A component's FLOPs per example: its own ``routing_flops(T)`` or, failing that, 2 per parameter per token."""
    own = getattr(component, "routing_flops", None)
    if callable(own):
        return float(own(T))
    if isinstance(component, nn.Module):
        return 2.0 * T * sum(p.numel() for p in component.parameters())
    return 0.0


def flop_fraction(layout: HeadLayout, plan: HeadPlan, T: int, S: int, extra_per_example: float) -> float:
    """Plan FLOPs plus routing FLOPs, relative to dense attention, over the batch."""
    B = plan.gates.shape[0]
    dense = dense_flops(layout, T, S) * B
    if dense == 0:  # no examples or no tokens: nothing to compute, nothing computed
        return 0.0
    total = plan_flops(layout, plan, T, S).sum() + extra_per_example * B
    return float(total / dense)


