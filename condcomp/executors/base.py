"""Steps every executor shares: per-head weight views, output bias and dead-row handling (the key/value
projection is in condcomp/dense.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from condcomp.types import AttentionWeights, HeadPlan


def per_head(t: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """An ``(n_heads * Dh, ...)`` projection weight or bias as ``(n_heads, Dh, ...)`` (a view when contiguous)."""
    return t.reshape(n_heads, head_dim, *t.shape[1:])


def qkv_head_rows(w: AttentionWeights) -> tuple[Tensor, Tensor | None]:
    """Self-attention's q, k, v projections as ``(3H, Dh * D)`` head blocks (every head's q, then k, then v) and
    their biases ``(3H, Dh)`` (a missing one, e.g. no key bias, is zeros; None when there is none at all).

    When q/k/v are consecutive slices of one fused in-projection (``nn.MultiheadAttention``, timm, the benchmark
    block) this is a view of it; otherwise one concatenation (``3 * D * D`` copied per call)."""
    H, Dh = w.layout.num_heads, w.layout.head_dim

    def fused(parts: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        q, k, v = parts
        base = q._base  # the tensor q was sliced from (None for a tensor that is not a view)
        n, step = q.numel(), q.numel() * q.element_size()
        if (base is not None and k._base is base and v._base is base and base.is_contiguous()
                and base.numel() == 3 * n and all(t.is_contiguous() for t in parts)
                and [t.data_ptr() for t in parts] == [base.data_ptr() + i * step for i in range(3)]):
            return base
        return torch.cat([t.reshape(-1) for t in parts])

    rows = fused((w.q_weight, w.k_weight, w.v_weight)).view(3 * H, -1)
    if w.q_bias is None and w.k_bias is None and w.v_bias is None:
        return rows, None
    q_b, k_b, v_b = (rows.new_zeros(H * Dh) if b is None else b for b in (w.q_bias, w.k_bias, w.v_bias))
    return rows, fused((q_b, k_b, v_b)).view(3 * H, Dh)


def any_active(plan: HeadPlan) -> Tensor:
    """``(B, 1, 1)`` or ``(B, T, 1)``: rows that get the output bias (rows with no head output exactly zero)."""
    if plan.granularity == "sequence":
        return (plan.counts > 0)[:, None, None]
    return (plan.counts > 0).unsqueeze(-1)


def add_output_bias(y: Tensor, w: AttentionWeights, plan: HeadPlan) -> Tensor:
    if w.o_bias is None:
        return y
    return y + w.o_bias * any_active(plan).to(y.dtype)


def keep_gates_in_graph(y: Tensor, plan: HeadPlan) -> Tensor:
    """``y`` unchanged, but joined to the gates' graph when no head ran anywhere (an all-zero output computed
    without them), so ``backward`` still reaches the router with zero gradients instead of failing."""
    if torch.is_grad_enabled() and not y.requires_grad and plan.gates.requires_grad:
        return y + plan.gates.sum().mul(0).to(y.dtype)
    return y


def zero_dead_rows(y: Tensor, dead: Tensor | None) -> Tensor:
    """Rows ``(B, T)`` with no key to attend to give exactly zero (not NaN, not the bias)."""
    if dead is None:
        return y
    return y.masked_fill(dead.unsqueeze(-1), 0.0)


def gate_of_head(plan: HeadPlan, h: int) -> Tensor:
    """Head ``h``'s gate broadcastable to ``(B, T, D)``."""
    if plan.granularity == "sequence":
        return plan.gates[:, h][:, None, None]
    return plan.gates[:, :, h].unsqueeze(-1)


