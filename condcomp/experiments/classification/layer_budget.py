"""Per-layer budgets for the study's controls: a fixed mean head count per layer, and a constant budget.

- :class:`LayerMeanPolicy` gives every example ``floor(m)`` or ``floor(m) + 1`` heads so that the mean over
  examples is ``m`` (a fractional per-layer mean, e.g. BudgetFormer's realised 5.99 heads in layer 0). Training
  rounds at random (torch's generator); evaluation rounds by a fixed low-discrepancy sequence over the batch
  positions, so evaluation is deterministic and the mean matches to within about one example per batch.
- :class:`ConstantBudgetPolicy` gives every example the same ``k`` heads and the same ``s``: a trained
  BudgetFormer with its per-input budget replaced by one value per layer (its most common k, its mean s).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from condcomp.api import routed_modules
from condcomp.types import Budget

_GOLDEN = (math.sqrt(5) - 1) / 2  # the additive recurrence u_i = frac((i + 1) * phi) covers [0, 1) evenly


class LayerMeanPolicy(nn.Module):
    """``k`` is ``floor(mean_heads)`` or one more, per example, with mean ``mean_heads``; ``s = k / H``.

    >>> p = LayerMeanPolicy(num_heads=8, mean_heads=2.5).eval()
    >>> p(torch.zeros(4, 3, 16), None).k.tolist()
    [2, 3, 2, 3]
    """

    def __init__(self, num_heads: int, mean_heads: float) -> None:
        super().__init__()
        if not 1.0 <= float(mean_heads) <= num_heads:
            raise ValueError(f"layer mean policy: mean_heads must lie in [1, {num_heads}], got {mean_heads}")
        self.num_heads, self.mean_heads = num_heads, float(mean_heads)

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        B = x.shape[0]
        low = math.floor(self.mean_heads)
        frac = self.mean_heads - low
        if self.training:
            u = torch.rand(B, device=x.device)  # (B,)
        else:
            u = torch.frac(torch.arange(1, B + 1, device=x.device, dtype=torch.float64) * _GOLDEN)
        k = (low + (u < frac).long()).clamp(1, self.num_heads)  # (B,)
        return Budget(s=k.float() / self.num_heads, k=k)

    def routing_flops(self, T: int) -> float:
        return 0.0


class ConstantBudgetPolicy(nn.Module):
    """Every example gets ``k`` heads and budget ``s`` (one value per layer)."""

    def __init__(self, num_heads: int, k: int, s: float) -> None:
        super().__init__()
        if not 1 <= int(k) <= num_heads:
            raise ValueError(f"constant budget policy: k must lie in [1, {num_heads}], got {k}")
        self.num_heads, self.k, self.s = num_heads, int(k), float(s)

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        B = x.shape[0]
        return Budget(s=torch.full((B,), self.s, device=x.device),
                      k=torch.full((B,), self.k, dtype=torch.long, device=x.device))

    def routing_flops(self, T: int) -> float:
        return 0.0


def install_layer_means(model: nn.Module, mean_heads: dict[str, float]) -> None:
    """Give every routed layer of ``model`` a :class:`LayerMeanPolicy` with its entry of ``mean_heads``."""
    routed = routed_modules(model)
    if set(mean_heads) != set(routed):
        raise ValueError(f"per-layer head counts name layers {sorted(mean_heads)}, the model has {sorted(routed)}")
    for name, r in routed.items():
        r.condcomp_policy = LayerMeanPolicy(r.layout.num_heads, mean_heads[name])
