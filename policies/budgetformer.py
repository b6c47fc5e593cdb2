"""BudgetFormer's budget predictor f_theta: pooled input -> 2-layer MLP -> sigmoid -> s, and the budget hinge."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from condcomp.options import MAX_WIDTH, Option, check_options, count, flag, real
from condcomp.plans import Rounding, budget_k, budget_k_bound
from condcomp.registry import register_policy
from condcomp.relaxations import masked_mean, rows_with_tokens, weighted_mean
from condcomp.types import Budget


def budget_hinge(s: Tensor, s_min: float, s_max: float, mask: Tensor | None = None) -> Tensor:
    """Mean quadratic hinge ``relu(s_min - s)^2 + relu(s - s_max)^2`` (zero inside [s_min, s_max]).

    ``s`` is ``(B,)`` or ``(B, T)``; ``mask`` (same shape, True = counts) leaves out rows without a real token
    or padding tokens. Nothing to count (an empty batch) gives 0, not NaN.

    >>> float(budget_hinge(torch.tensor([0.5, 0.95, 0.0]), 0.1, 0.9))  # (0 + 0.05**2 + 0.1**2) / 3
    0.004166...
    """
    s = s.float()
    per_row = torch.relu(s_min - s) ** 2 + torch.relu(s - s_max) ** 2
    return weighted_mean(per_row, mask)


# BudgetFormer's numeric options, checked for every BudgetFormer policy by the one option check (condcomp.options)
BUDGET_OPTIONS: tuple[Option, ...] = (
    real("s_min", at_least=0, at_most=1, meaning="the budget interval's low end"),
    real("s_max", at_least=0, at_most=1, meaning="the budget interval's high end"),
    real("budget_weight", at_least=0, meaning="the hinge's weight"),
    count("hidden", at_least=1, at_most=MAX_WIDTH, optional=True, meaning="MLP width; None: max(16, d_model // 4)"),
    real("init_s", above=0, below=1, meaning="a sigmoid output"),
    count("k_min", meaning="fewest heads per row"),
    flag("cap_at_s_max", meaning="cap k at floor(s_max * H)"),
)


def validate_budget_options(owner: str, s_min: float, s_max: float, init_s: float, budget_weight: float,
                            k_min: int, rounding: str, hidden: int | None) -> None:
    """Shared checks of the BudgetFormer policies' options (clear errors at config time): each number by
    :data:`BUDGET_OPTIONS`, then the interval and the rounding."""
    check_options(owner, BUDGET_OPTIONS, {"s_min": s_min, "s_max": s_max, "init_s": init_s,
                                          "budget_weight": budget_weight, "k_min": k_min, "hidden": hidden})
    if s_min > s_max:
        raise ValueError(f"{owner}: s_min={s_min} is greater than s_max={s_max}; the budget interval is empty")
    if rounding not in ("floor", "ceil", "round"):
        raise ValueError(f"{owner}: rounding must be 'floor', 'ceil' or 'round', got {rounding!r}")


class BudgetMLP(nn.Module):
    """``Linear(D, hidden) -> GELU -> Linear(hidden, 1) -> sigmoid``, float32, initialised to output ``init_s``.

    The last layer's weights start small (x0.1) and its bias at ``logit(init_s)``: every input starts near
    ``init_s`` (no early collapse to 0 or 1 heads) while every parameter still receives a gradient.
    """

    def __init__(self, d_model: int, hidden: int, init_s: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, 1)
        with torch.no_grad():
            self.fc2.weight.mul_(0.1)
            self.fc2.bias.fill_(math.log(init_s / (1.0 - init_s)))

    def forward(self, h: Tensor) -> Tensor:
        return torch.sigmoid(self.fc2(nn.functional.gelu(self.fc1(h.float())))).squeeze(-1)

    def flops(self, rows: int) -> float:
        """Multiply-add FLOPs of ``rows`` MLP evaluations."""
        D, hidden = self.fc1.in_features, self.fc1.out_features
        return 2.0 * rows * (D * hidden + hidden)


@register_policy("budgetformer")
class BudgetFormerPolicy(nn.Module):
    """f_theta: masked mean-pool over real tokens, 2-layer MLP, sigmoid -> ``s (B,)``; ``k = budget_k(s, H)``.

    Returns ``aux_losses["budget"] = budget_weight * mean(relu(s_min - s)^2 + relu(s - s_max)^2)``. ``s`` keeps
    its graph so a router (``topk``) can pass the task loss back to f_theta; the hinge is not its only signal.
    One instance may serve every layer (``CondCompConfig(share_policy=True)``): it is stateless between calls.

    Options: ``s_min``/``s_max`` (0.1, 0.9: the paper's interval), ``budget_weight`` (10: holds s close to the
    interval against the task's pull towards more heads; see docs/methods.md), ``hidden`` (MLP
    width, default ``max(16, d_model // 4)``), ``init_s`` (0.6: a little above the middle so early training
    starts with most heads, as a dense model would), ``k_min`` (1), ``rounding`` ("floor").

    ``cap_at_s_max`` (False): the sigmoid's ``s`` can reach 1, so the budget's declared bound (``Budget.k_cap``)
    is H and the gathered executor's capturable path (``sequence.static``: under ``torch.compile``, and on CUDA)
    pads every example to H heads, a dense cost. ``cap_at_s_max=True`` changes the budget rule to
    ``k = clamp(floor(s * H), k_min, k_cap)`` with ``k_cap = budget_k(s_max)``: rows whose ``s`` exceeds
    ``s_max`` get ``k_cap`` heads instead of ``floor(s * H)`` (``s`` itself, its hinge and its gradient are
    unchanged), and that path computes ``k_cap`` heads per example.

    >>> p = BudgetFormerPolicy(d_model=16, num_heads=8)
    >>> b = p(torch.randn(2, 5, 16), None)
    >>> b.s.shape, b.k.tolist()
    (torch.Size([2]), [4, 4])
    """

    label = "budgetformer policy"  # how errors name it (the per-token subclass has its own)
    options: ClassVar[tuple[Option, ...]] = BUDGET_OPTIONS

    def __init__(self, d_model: int, num_heads: int, s_min: float = 0.1, s_max: float = 0.9,
                 budget_weight: float = 10.0, hidden: int | None = None, init_s: float = 0.6, k_min: int = 1,
                 rounding: Rounding = "floor", cap_at_s_max: bool = False) -> None:
        super().__init__()
        self.validate_options(s_min=s_min, s_max=s_max, budget_weight=budget_weight, hidden=hidden, init_s=init_s,
                              k_min=k_min, rounding=rounding)
        if k_min > num_heads:
            raise ValueError(f"{self.label}: k_min={k_min} exceeds the layer's {num_heads} heads")
        self.num_heads, self.s_min, self.s_max = num_heads, float(s_min), float(s_max)
        self.budget_weight, self.k_min, self.rounding = float(budget_weight), k_min, rounding
        self.cap_at_s_max = bool(cap_at_s_max)
        self.mlp = BudgetMLP(d_model, hidden or max(16, d_model // 4), init_s)

    @classmethod
    def validate_options(cls, s_min: float = 0.1, s_max: float = 0.9, budget_weight: float = 10.0,
                         hidden: int | None = None, init_s: float = 0.6, k_min: int = 1, rounding: str = "floor",
                         **_: Any) -> None:
        validate_budget_options(cls.label, s_min, s_max, init_s, budget_weight, k_min, rounding, hidden)

    @property
    def k_cap(self) -> int:
        """The bound on every row's k this policy declares: H, or ``budget_k(s_max)`` with ``cap_at_s_max``."""
        if not self.cap_at_s_max:
            return int(self.num_heads)
        return budget_k_bound(self.s_max, self.num_heads, self.k_min, self.rounding)  # type: ignore[arg-type]

    def budget_of(self, s: Tensor, x: Tensor, mask: Tensor | None) -> Budget:
        """The budget of predicted fractions ``s``: k by the budget rule (capped with ``cap_at_s_max``), the
        hinge on ``[s_min, s_max]`` over the rows with a real token, and the declared ``k_cap``."""
        k = budget_k(s, self.num_heads, self.k_min, self.rounding)  # type: ignore[arg-type]
        cap = self.k_cap
        if self.cap_at_s_max:
            k = k.clamp(max=cap)
        hinge = self.budget_weight * budget_hinge(s, self.s_min, self.s_max, rows_with_tokens(x, mask))
        return Budget(s=s, k=k, aux_losses={"budget": hinge}, k_cap=cap)

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        s = self.mlp(masked_mean(x.float(), mask))  # (B,)
        return self.budget_of(s, x, mask)

    def routing_flops(self, T: int) -> float:
        """Per example: the pooling adds plus one MLP evaluation."""
        return float(T * self.mlp.fc1.in_features) + self.mlp.flops(1)
