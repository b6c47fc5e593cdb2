"""The ``random`` router: k heads drawn uniformly per row (the "which heads matters" control)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from condcomp.plans import plan_top_k
from condcomp.registry import register_router
from condcomp.types import AttentionWeights, Budget, HeadPlan


@register_router("random")
class RandomRouter(nn.Module):
    """Selects ``budget.k`` heads uniformly at random per example (or per token), binary gates.

    Draws from torch's global generator (seed it for reproducible runs); in eval mode too, by design: it is
    the control that tells whether *which* heads a learned router picks matters.
    """

    granularity = "sequence"

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan:
        rows = budget.k.shape  # (B,) or (B, T)
        scores = torch.rand(*rows, self.num_heads, device=x.device)
        token_mask = mask if (budget.k.dim() == 2 and mask is not None) else None
        return plan_top_k(scores, budget.k, gates="binary", mask=token_mask)
