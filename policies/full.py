"""The ``full`` policy: every head, always (the standard Transformer)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from condcomp.registry import register_policy
from condcomp.types import Budget


@register_policy("full")
class FullPolicy(nn.Module):
    """s = 1 and k = H for every example.

    >>> FullPolicy(num_heads=8)(torch.randn(2, 3, 16), None).k.tolist()
    [8, 8]
    """

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        B = x.shape[0]
        return Budget(s=torch.ones(B, device=x.device), k=torch.full((B,), self.num_heads, device=x.device),
                      k_cap=self.num_heads, k_floor=self.num_heads)
