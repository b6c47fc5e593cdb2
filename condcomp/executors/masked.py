"""Every head with one fused SDPA call, then the gates: what MoH's released code does, and dense attention."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from condcomp.dense import all_heads_attention
from condcomp.executors.base import add_output_bias, zero_dead_rows
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


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
