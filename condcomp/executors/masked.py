"""Every head with one fused SDPA call, then the gates: what MoH's released code does, and dense attention."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from condcomp.executors.base import add_output_bias, project_kv, zero_dead_rows
from condcomp.masks import apply_rotary, build_attention_mask, dead_rows
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


def all_heads_attention(weights: AttentionWeights, inputs: AttentionInputs) -> tuple[Tensor, Tensor | None]:
    """Every head's attention output ``(B, H, T, Dh)`` and the dead query rows ``(B, T)`` (or None)."""
    x = inputs.x
    B, T, _ = x.shape
    L = weights.layout
    mask = build_attention_mask(inputs, L.causal, x.dtype)
    q = F.linear(x, weights.q_weight, weights.q_bias).unflatten(-1, (L.num_heads, L.head_dim)).transpose(1, 2)
    if inputs.rotary is not None:
        q = apply_rotary(q, *inputs.rotary)
    k, v = project_kv(weights, inputs)  # (B, Hkv, S, Dh)
    if L.group_size > 1:
        k = k.repeat_interleave(L.group_size, dim=1)
        v = v.repeat_interleave(L.group_size, dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.mask, dropout_p=inputs.dropout_p, is_causal=mask.is_causal, scale=L.scale
    )  # (B, H, T, Dh)
    if mask.dead is not None:
        out = out.masked_fill(mask.dead.unsqueeze(-1), 0.0)
    return out, dead_rows(mask, B, T)


@register_executor("masked")
class MaskedExecutor:
    """Computes all heads densely and multiplies by the gates: correct for any plan, saves nothing.

    It is the fastest choice at full budget (it *is* dense attention) and the honest baseline for what masking
    costs elsewhere.
    """

    name = "masked"
    granularities = ("sequence", "token")
    capabilities = Capabilities()

    def supports(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> str | None:
        return None

    def estimate(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Estimate:
        return Estimate(1.0, note="dense attention over every head")

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        out, dead = all_heads_attention(weights, inputs)  # (B, H, T, Dh)
        B, H, T, Dh = out.shape
        if plan.granularity == "sequence":
            gates = plan.gates[:, :, None, None]  # (B, H, 1, 1)
        else:
            gates = plan.gates.transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
        out = out * gates.to(out.dtype)
        y = F.linear(out.transpose(1, 2).reshape(B, T, H * Dh), weights.o_weight)  # (B, T, D)
        return zero_dead_rows(add_output_bias(y, weights, plan), dead)
