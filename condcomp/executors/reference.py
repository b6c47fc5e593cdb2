"""The per-head loop: slow, obvious, and the oracle every other executor is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.dense import project_kv
from condcomp.executors.base import add_output_bias, gate_of_head, zero_dead_rows
from condcomp.masks import build_attention_mask, dead_rows
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


@register_executor("reference")
class ReferenceExecutor:
    """One head at a time with an explicit softmax; any dtype (float64 for gradcheck), any device.

    It computes every head for every row and multiplies by the gate (zero for inactive heads, which carry no
    gradient), so it is a faithful reading of ``y = sum_h g_h A_h W_O^h`` and nothing more.

    >>> import condcomp
    >>> "reference" in condcomp.list_executors()
    True
    """

    name = "reference"
    granularities = ("sequence", "token")
    capabilities = Capabilities()

    def supports(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> str | None:
        return None

    def estimate(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Estimate:
        # every head, one kernel sequence per head with an explicit softmax: several times dense attention
        return Estimate(2.0 * weights.layout.num_heads, note="one head at a time: the oracle")

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        x = inputs.x
        B, T, _ = x.shape
        L = weights.layout
        Dh = L.head_dim
        mask = build_attention_mask(inputs, L.causal, x.dtype)
        k_all, v_all = project_kv(weights, inputs)  # (B, Hkv, S, Dh)
        y = x.new_zeros(B, T, weights.o_weight.shape[0])
        for h in range(L.num_heads):
            rows = slice(h * Dh, (h + 1) * Dh)
            q_bias = None if weights.q_bias is None else weights.q_bias[rows]
            q = weights.norm_queries(F.linear(x, weights.q_weight[rows], q_bias))  # (B, T, Dh)
            if inputs.rotary is not None:
                q = apply_rotary(q.unsqueeze(1), *inputs.rotary).squeeze(1)
            g = h // L.group_size
            k, v = k_all[:, g], v_all[:, g]  # (B, S, Dh)
            scores = q @ k.transpose(-1, -2) * L.scale  # (B, T, S)
            if mask.mask is not None:
                m = mask.mask[:, 0 if mask.mask.shape[1] == 1 else h]
                if m.dtype == torch.bool:
                    scores = scores.masked_fill(~m, float("-inf"))
                else:
                    scores = scores + m
            elif mask.is_causal:
                allowed = torch.ones(T, k.shape[1], dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if inputs.dropout_p > 0:
                probs = F.dropout(probs, inputs.dropout_p, training=True)
            out = probs @ v  # (B, T, Dh)
            if mask.dead is not None:
                out = out.masked_fill(mask.dead[:, 0 if mask.dead.shape[1] == 1 else h].unsqueeze(-1), 0.0)
            y = y + gate_of_head(plan, h).to(y.dtype) * F.linear(out, weights.o_weight[:, rows])
        y = add_output_bias(y, weights, plan)
        return zero_dead_rows(y, dead_rows(mask, B, T))
