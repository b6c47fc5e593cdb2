"""SnapKV's token score written from scratch in float64, for the snapkv and adakv tests: how much the last
``observe`` real queries of a group's heads attend to each scored prompt token, summed over the heads and queries,
then averaged over a window of ``pool`` neighbours."""

from __future__ import annotations

import math

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
