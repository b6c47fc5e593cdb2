"""BudgetFormer's budget predictor that also reads a per-example conditioning vector (e.g. a diffusion model's
timestep and class embedding): a budget that can follow the noise level."""

from __future__ import annotations

from typing import ClassVar

import torch
from condcomp.policies.budgetformer import BudgetFormerPolicy, BudgetMLP
from torch import Tensor, nn

from condcomp.options import MAX_WIDTH, Option, count
from condcomp.plans import Rounding
from condcomp.registry import register_policy
from condcomp.relaxations import masked_mean
from condcomp.types import Budget


@register_policy("budgetformer_cond")
class ConditionedBudgetPolicy(BudgetFormerPolicy):
    """f_theta on ``[LayerNorm(pool(x)), LayerNorm(condition)]``: 2-layer MLP, sigmoid -> ``s (B,)``.

    The layer passes ``condition (B, Dc)`` from its caller (``HeadAttention(x, condition=c)``; the DiT of
    ``condcomp.experiments.dit`` passes its adaLN conditioning vector, timestep plus class embedding), because the
    policy declares ``reads_condition = True``. Both parts are layer-normalised (no affine) so neither swamps the
    other whatever their scales. Everything else is :class:`~condcomp.policies.budgetformer.BudgetFormerPolicy`:
    ``k = budget_k(s, H)``, the budget hinge on ``[s_min, s_max]``, ``s`` differentiable for the router.

    Options: those of ``budgetformer`` plus ``condition_dim`` (``Dc``; default the layer's ``d_model``, as in a
    DiT whose conditioning vector has the model's width). Calling it without a condition is an error: a budget
    that silently ignored the noise level would measure something else.

    >>> p = ConditionedBudgetPolicy(d_model=16, num_heads=8, condition_dim=4)
    >>> p(torch.randn(2, 5, 16), None, condition=torch.randn(2, 4)).k.tolist()
    [4, 4]
    """

    label = "budgetformer_cond policy"
    options: ClassVar[tuple[Option, ...]] = (
        *BudgetFormerPolicy.options,
        count("condition_dim", at_least=1, at_most=MAX_WIDTH, optional=True, meaning="Dc; None: d_model"))
    reads_condition = True

    def __init__(self, d_model: int, num_heads: int, condition_dim: int | None = None, s_min: float = 0.1,
                 s_max: float = 0.9, budget_weight: float = 10.0, hidden: int | None = None, init_s: float = 0.6,
                 k_min: int = 1, rounding: Rounding = "floor", cap_at_s_max: bool = False) -> None:
        super().__init__(d_model, num_heads, s_min=s_min, s_max=s_max, budget_weight=budget_weight, hidden=hidden,
                         init_s=init_s, k_min=k_min, rounding=rounding, cap_at_s_max=cap_at_s_max)
        self.d_model = d_model
        self.condition_dim = int(condition_dim or d_model)
        self.mlp = BudgetMLP(d_model + self.condition_dim, hidden or max(16, d_model // 4), init_s)

    def forward(self, x: Tensor, mask: Tensor | None, condition: Tensor | None = None) -> Budget:  # type: ignore[override]
        B = x.shape[0]
        if condition is None:
            raise ValueError(f"{self.label}: no condition was passed; call the attention layer with "
                             f"condition=(B, {self.condition_dim}) (a DiT's timestep embedding), or use the "
                             "'budgetformer' policy")
        if condition.dim() != 2 or tuple(condition.shape) != (B, self.condition_dim):
            raise ValueError(f"{self.label}: condition must be (B, Dc) = {(B, self.condition_dim)}, "
                             f"got {tuple(condition.shape)}")
        pooled = nn.functional.layer_norm(masked_mean(x.float(), mask), (self.d_model,))  # (B, D)
        cond = nn.functional.layer_norm(condition.float(), (self.condition_dim,))  # (B, Dc)
        s = self.mlp(torch.cat([pooled, cond], dim=-1))  # (B,)
        return self.budget_of(s, x, mask)

    def routing_flops(self, T: int) -> float:
        """Per example: the pooling adds, the two normalisations and one MLP evaluation."""
        return float(T * self.d_model) + 5.0 * (self.d_model + self.condition_dim) + self.mlp.flops(1)
