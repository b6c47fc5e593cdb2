"""SnapKV's token score written from scratch in float64, for the snapkv and adakv tests: how much the last
``observe`` real queries of a group's heads attend to each scored prompt token, summed over the heads and queries,
then averaged over a window of ``pool`` neighbours; and the attention bias a policy keeping chosen prompt tokens
implies."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from condcomp.types import AttentionWeights


def pooled_scores(w: AttentionWeights, x: Tensor, real: list[int], g: int, observe: int, scored: list[int],
                  pool: int) -> dict[int, float]:
    """``x (S, D)``: one row's inputs; ``real``: its real prompt positions; the pooled score of each index in
    ``scored`` for key/value group ``g``."""
    L = w.layout
    Dh, r = L.head_dim, L.group_size
    obs = real[-observe:]
    k = x @ w.k_weight[g * Dh:(g + 1) * Dh].T  # (S, Dh)
    score = {j: 0.0 for j in scored}
    for h in range(g * r, (g + 1) * r):
        q = x @ w.q_weight[h * Dh:(h + 1) * Dh].T
        for i in obs:
            seen = [j for j in real if j <= i]
            logits = [float(q[i] @ k[j]) * L.scale for j in seen]
            top = max(logits)
            z = sum(math.exp(v - top) for v in logits)
            for j, v in zip(seen, logits):
                if j in score:
                    score[j] += math.exp(v - top) / z
    half = pool // 2
    return {j: sum(score.get(j + d, 0.0) for d in range(-half, half + 1)) / pool for j in scored}


def kept_prompt_bias(mask: Tensor, held: Tensor, kept: Callable[[int, int], set[int]], prompt: int, num_heads: int,
                     group_size: int) -> Tensor:
    """``(B, H, S, S)`` float64, written from the rule: causal over the real tokens (``mask (B, S)``); the heads of a
    group ``held[b, g]`` by a token-selecting policy read, after the ``prompt``, only the prompt tokens
    ``kept(b, g)`` returns (and every later token)."""
    B, S = mask.shape
    bias = torch.full((B, num_heads, S, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        chosen = {g: kept(b, g) for g in range(held.shape[1]) if held[b, g]}
        for h in range(num_heads):
            g = h // group_size
            for i in range(S):
                for j in range(i + 1):
                    if not (mask[b, i] and mask[b, j]):
                        continue
                    if held[b, g] and i >= prompt and j < prompt and j not in chosen[g]:
                        continue
                    bias[b, h, i, j] = 0.0
    return bias
