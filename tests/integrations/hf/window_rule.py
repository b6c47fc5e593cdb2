"""The streaming rule written from scratch in float64: the oracle of the streamed-group tests.

Attention key by key (per row, head and query: the keys the rules allow, softmax, the plan's gate) over the whole
sequence in one forward without a cache, in a float64 copy of the wrapped model whose attention layers are replaced
by it; it shares no code with the cached path.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from decode_helpers import positions
from torch import nn

import condcomp
from condcomp.kv.selection import KV_WINDOW, RequestPlan


def _rotate(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def rule_attention(routed: Any, plan: RequestPlan, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor, sinks: int, window: int, model_window: int | None) -> torch.Tensor:
    """One layer's output: a full group's heads read causal keys (within the model's own window when it has one),
    a streamed group's heads also only the first ``sinks`` and the last ``window`` tokens; skipped heads
    contribute nothing."""
    B, T, _ = x.shape
    H, Hkv = plan.heads.shape[1], plan.kv_groups.shape[1]
    Dh = routed.q_proj.out_features // H
    cos, sin = (c.unsqueeze(1) for c in rotary)  # (B, 1, T, Dh)
    q = routed.q_proj(x).view(B, T, H, Dh).transpose(1, 2)
    k = routed.k_proj(x).view(B, T, Hkv, Dh).transpose(1, 2)
    v = routed.v_proj(x).view(B, T, Hkv, Dh).transpose(1, 2)
    q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
    pos = (mask.long().cumsum(-1) - 1).tolist()
    out = torch.zeros(B, H, T, Dh, dtype=x.dtype)
    assert plan.kv_modes is not None
    for b in range(B):
        for h in range(H):
            gate = float(plan.gates[b, h]) if bool(plan.heads[b, h]) else 0.0
            g = h // (H // Hkv)
            streamed = int(plan.kv_modes[b, g]) == KV_WINDOW
            for i in range(T):
                if not mask[b, i] or gate == 0.0:
                    continue
                p = pos[b][i]
                keys = [j for j in range(i + 1) if mask[b, j] and (model_window is None or p - pos[b][j] < model_window)
                        and (not streamed or pos[b][j] < sinks or p - pos[b][j] < window)]
                scores = (k[b, g, keys] @ q[b, h, i]) * Dh**-0.5
                out[b, h, i] = gate * (scores.softmax(-1) @ v[b, g, keys])
    return routed.o_proj(out.transpose(1, 2).reshape(B, T, H * Dh))  # type: ignore[no-any-return]


@torch.no_grad()
def rule_logits(model: nn.Module, plans: dict[str, RequestPlan], tokens: torch.Tensor, mask: torch.Tensor,
                sinks: int, window: int, model_window: int | None = None) -> torch.Tensor:
    """``(B, S, V)`` float64 logits of ``tokens`` under each layer's request plan and the rules."""
    ref = copy.deepcopy(model).double()
    for name, routed in condcomp.api.routed_modules(ref).items():
        def forward(hidden_states: torch.Tensor, position_embeddings: Any = None, _routed: Any = routed,
                    _plan: RequestPlan = plans[name], **_: Any) -> tuple[torch.Tensor, None]:
            return rule_attention(_routed, _plan, hidden_states, position_embeddings, mask.bool(), sinks, window,
                                  model_window), None

        routed.forward = forward
    return ref(input_ids=tokens, attention_mask=mask, position_ids=positions(mask),  # type: ignore[no-any-return]
               use_cache=False).logits
