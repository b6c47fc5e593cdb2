"""A decode step's FLOPs under a KV policy, counted by hand, for the head_usage tests of the token-selection
policies: full groups read all ``S`` keys, held groups their ``n`` kept entries; against the dense layer's count."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from condcomp.flops import routing_flops


def flop_frac_by_hand(config: Any, routed: Any, full: Tensor, held: Tensor, T: int, S: int, n: int) -> float:
    """``full``/``held`` ``(B,)``: each row's groups kept in full and held by the policy; ``routed``: the wrapped
    attention module (its policy's and router's FLOPs are added per row)."""
    D, H, Hkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    Dh, r = D // H, H // Hkv
    per_row = [T * (int(f) * r * (2 * D * Dh + 4 * S * Dh + 2 * Dh * D)) + int(f) * 2 * S * 2 * D * Dh
               + T * (int(w) * r * (2 * D * Dh + 4 * n * Dh + 2 * Dh * D)) + int(w) * 2 * n * 2 * D * Dh
               for f, w in zip(full.tolist(), held.tolist())]
    dense = 2 * T * D * H * Dh + 2 * S * 2 * D * Hkv * Dh + 2 * T * H * Dh * D + 4 * T * S * H * Dh
    extra = routing_flops(routed.condcomp_policy, T) + routing_flops(routed.condcomp_router, T)
    return (sum(per_row) + extra * len(per_row)) / (dense * len(per_row))
