"""Token-level BudgetFormer (the paper's future work): f_theta applied to every token instead of the pooled input."""

from __future__ import annotations

import torch  # noqa: F401  (the docstring example uses it)
from torch import Tensor

from condcomp.plans import budget_k
from condcomp.registry import register_policy
from condcomp.types import Budget

from .budgetformer import BudgetFormerPolicy, budget_hinge


@register_policy("budgetformer_token")
class TokenBudgetPolicy(BudgetFormerPolicy):
    """Per-token budget: the same 2-layer MLP + sigmoid on each token -> ``s (B, T)``, ``k (B, T)``.

    Padding tokens (``mask`` False) get ``k = 0`` (no heads: that is where token plans save compute) and are
    left out of the hinge ``aux_losses["budget"]``, a mean over real tokens. Pair it with a router that routes
    tokens (``moh``, ``norm``, or ``topk``, which then scores each token). Options as ``budgetformer``.

    >>> p = TokenBudgetPolicy(d_model=16, num_heads=4)
    >>> p(torch.randn(2, 3, 16), torch.tensor([[True, True, False], [True, True, True]])).k.tolist()
    [[2, 2, 0], [2, 2, 2]]
    """

    label = "budgetformer_token policy"

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        s = self.mlp(x.float())  # (B, T)
        k = budget_k(s, self.num_heads, self.k_min, self.rounding)  # type: ignore[arg-type]
        if self.cap_at_s_max:
            k = k.clamp(max=self.k_cap)
        if mask is not None:
            k = k.masked_fill(~mask.bool(), 0)
        hinge = self.budget_weight * budget_hinge(s, self.s_min, self.s_max, mask)
        return Budget(s=s, k=k, aux_losses={"budget": hinge}, k_cap=self.k_cap)

    def routing_flops(self, T: int) -> float:
        """Per example: one MLP evaluation per token."""
        return self.mlp.flops(T)

