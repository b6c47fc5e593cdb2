"""Steps every executor shares: key/value projection, output bias and dead-row handling."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.masks import apply_rotary
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


def project_kv(w: AttentionWeights, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
    """Keys and values of every key/value head, ``(B, Hkv, S, Dh)`` each (rotary applied to keys)."""
    if inputs.key_states is not None and inputs.value_states is not None:
        return inputs.key_states, inputs.value_states
    Hkv, Dh = w.layout.num_kv_heads, w.layout.head_dim
    k = F.linear(inputs.key_input, w.k_weight, w.k_bias).unflatten(-1, (Hkv, Dh)).transpose(1, 2)
    v = F.linear(inputs.value_input, w.v_weight, w.v_bias).unflatten(-1, (Hkv, Dh)).transpose(1, 2)
    if inputs.rotary is not None:
        k = apply_rotary(k, *inputs.rotary)
    return k, v


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


