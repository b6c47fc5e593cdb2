"""Token-level BudgetFormer (the paper's future work): f_theta applied to every token instead of the pooled input."""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (the docstring example uses it)
from torch import Tensor, nn

from condcomp.plans import Rounding, budget_k
from condcomp.registry import register_policy
from condcomp.types import Budget

from .budgetformer import BudgetMLP, budget_hinge, validate_budget_options


@register_policy("budgetformer_token")
class TokenBudgetPolicy(nn.Module):
    """Per-token budget: the same 2-layer MLP + sigmoid on each token -> ``s (B, T)``, ``k (B, T)``.

    Padding tokens (``mask`` False) get ``k = 0`` (no heads: that is where token plans save compute) and are
    left out of the hinge ``aux_losses["budget"]``, a mean over real tokens. Pair it with a router that routes
    tokens (``moh``, ``norm``, or ``topk``, which then scores each token). Options as ``budgetformer``.

    >>> p = TokenBudgetPolicy(d_model=16, num_heads=4)
    >>> p(torch.randn(2, 3, 16), torch.tensor([[True, True, False], [True, True, True]])).k.tolist()
    [[2, 2, 0], [2, 2, 2]]
    """

    def __init__(self, d_model: int, num_heads: int, s_min: float = 0.1, s_max: float = 0.9,
                 budget_weight: float = 10.0, hidden: int | None = None, init_s: float = 0.6, k_min: int = 1,
                 rounding: Rounding = "floor") -> None:
        super().__init__()
        self.validate_options(s_min=s_min, s_max=s_max, budget_weight=budget_weight, hidden=hidden, init_s=init_s,
                              k_min=k_min, rounding=rounding)
        if k_min > num_heads:
            raise ValueError(f"budgetformer_token policy: k_min={k_min} exceeds the layer's {num_heads} heads")
        self.num_heads, self.s_min, self.s_max = num_heads, float(s_min), float(s_max)
        self.budget_weight, self.k_min, self.rounding = float(budget_weight), k_min, rounding
        self.mlp = BudgetMLP(d_model, hidden or max(16, d_model // 4), init_s)

    @staticmethod
    def validate_options(s_min: float = 0.1, s_max: float = 0.9, budget_weight: float = 10.0,
                         hidden: int | None = None, init_s: float = 0.6, k_min: int = 1, rounding: str = "floor",
                         **_: Any) -> None:
        validate_budget_options("budgetformer_token policy", s_min, s_max, init_s, budget_weight, k_min, rounding,
                                hidden)

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        s = self.mlp(x.float())  # (B, T)
        k = budget_k(s, self.num_heads, self.k_min, self.rounding)  # type: ignore[arg-type]
        if mask is not None:
            k = k.masked_fill(~mask.bool(), 0)
        hinge = self.budget_weight * budget_hinge(s, self.s_min, self.s_max, mask)
        return Budget(s=s, k=k, aux_losses={"budget": hinge})

    def routing_flops(self, T: int) -> float:
        """Per example: one MLP evaluation per token."""
        return self.mlp.flops(T)

