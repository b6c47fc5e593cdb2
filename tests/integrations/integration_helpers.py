"""Helpers of the integration tests: a deterministic head-choosing router and reference helpers.

The reference for a partial budget is independent of condcomp's executors: the *unwrapped* model with the output
projection columns of the skipped heads set to zero computes exactly ``sum over kept heads of A_h W_O^h`` (+ bias),
which is what a binary plan that keeps those heads must give.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from core_helpers import state_equal  # noqa: F401  (the integration tests import it from here)
from torch import Tensor, nn

import condcomp
from condcomp.plans import plan_top_k
from condcomp.registry import ROUTERS

# Head preference of the "prefer" router: a fixed, non-trivial order (not simply the first heads).
PREFERENCE = (1, 3, 0, 2, 5, 7, 4, 6, 9, 11, 8, 10)


class PreferRouter(nn.Module):
    """Keeps the ``budget.k`` heads that come first in ``PREFERENCE``: the same heads for every example."""

    granularity = "sequence"

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def forward(self, x: Tensor, mask: Tensor | None, budget: condcomp.Budget, attn: object) -> condcomp.HeadPlan:
        order = [h for h in PREFERENCE if h < self.num_heads]
        rank = torch.empty(self.num_heads)
        rank[torch.tensor(order)] = torch.arange(self.num_heads, 0, -1, dtype=torch.float32)
        return plan_top_k(rank.to(x.device).expand(x.shape[0], -1), budget.k, gates="binary")


def kept_heads(num_heads: int, fraction: float) -> list[int]:
    k = max(1, int(fraction * num_heads))
    return sorted([h for h in PREFERENCE if h < num_heads][:k])


@pytest.fixture
def prefer_router() -> Iterator[str]:
    """Registers the ``prefer`` router for one test and removes it afterwards."""
    ROUTERS.register("prefer")(PreferRouter)
    try:
        yield "prefer"
    finally:
        ROUTERS._entries.pop("prefer", None)


def zero_heads_(linear: nn.Linear, keep: list[int], head_dim: int) -> None:
    """Zero the input columns of ``linear`` (an output projection) that belong to heads not in ``keep``."""
    with torch.no_grad():
        cols = torch.ones(linear.in_features, dtype=torch.bool)
        for h in keep:
            cols[h * head_dim:(h + 1) * head_dim] = False
        linear.weight[:, cols] = 0.0
