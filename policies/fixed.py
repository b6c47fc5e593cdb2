"""The ``fixed`` policy: a static fraction of heads for every input (fixed top-k routing)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from condcomp.options import Option, check_options, count, flag, real
from condcomp.plans import Rounding, budget_k, budget_k_bound
from condcomp.registry import register_policy
from condcomp.types import Budget


@register_policy("fixed")
class FixedPolicy(nn.Module):
    """``s = fraction`` for every example; ``k = clamp(floor(s * H), k_min, H)`` (``rounding`` may be ``"ceil"``).

    ``per_token=True`` gives the same budget to every token (for token routers). The budget declares its k as
    ``k_cap`` and ``k_floor`` (known before any input: the gathered executor's capturable path computes exactly k
    heads per row).

    >>> FixedPolicy(num_heads=8, fraction=0.3)(torch.randn(2, 3, 16), None).k.tolist()
    [2, 2]
    """

    options: ClassVar[tuple[Option, ...]] = (
        real("fraction", at_least=0, at_most=1, meaning="of the layer's heads"),
        count("k_min", meaning="fewest heads per row"),
        flag("per_token", meaning="one budget per token"),
    )

    def __init__(self, num_heads: int, fraction: float = 0.5, k_min: int = 1, rounding: Rounding = "floor",
                 per_token: bool = False) -> None:
        super().__init__()
        self._check(num_heads, fraction, k_min, rounding)
        self.num_heads, self.fraction, self.k_min, self.rounding = num_heads, fraction, k_min, rounding
        self.per_token = per_token

    _CAP_FIELDS: ClassVar[tuple[str, ...]] = ("num_heads", "fraction", "k_min", "rounding")
    _cap: int

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting ``fraction``, ``k_min`` or ``rounding`` on a built policy (a budget sweep) checks the value and
        recomputes the declared cap as a host int: ``torch.compile`` recompiles on a changed int attribute, while
        it traces a changed float as a symbol that the host rounding of :func:`budget_k_bound` cannot take (a
        ``fullgraph=True`` model failed with "torch.* op returned non-Tensor" after ``policy.fraction = 0.25``)."""
        if name in self._CAP_FIELDS[1:] and all(f in self.__dict__ for f in self._CAP_FIELDS):
            self._check(**({f: getattr(self, f) for f in self._CAP_FIELDS} | {name: value}))
        super().__setattr__(name, value)
        if name in self._CAP_FIELDS and all(f in self.__dict__ for f in self._CAP_FIELDS):
            self._keep_cap()

    def __setstate__(self, state: dict[str, Any]) -> None:  # one pickled before the cap was kept gets it
        super().__setstate__(state)
        self._keep_cap()

    def _keep_cap(self) -> None:
        super().__setattr__("_cap", budget_k_bound(float(self.fraction), self.num_heads, self.k_min,
                                                   self.rounding))  # type: ignore[arg-type]

    @classmethod
    def _check(cls, num_heads: int, fraction: float, k_min: int, rounding: Rounding) -> None:
        """Refuse options a layer of ``num_heads`` heads cannot take (at construction, and when one is set)."""
        cls.validate_options(fraction=fraction, k_min=k_min, rounding=rounding)
        if k_min > num_heads:
            raise ValueError(f"fixed policy: k_min={k_min} exceeds the layer's {num_heads} heads")

    @staticmethod
    def validate_options(fraction: float = 0.5, k_min: int = 1, rounding: str = "floor", **_: object) -> None:
        check_options("fixed policy", FixedPolicy.options, {"fraction": fraction, "k_min": k_min})
        if rounding not in ("floor", "ceil", "round"):
            raise ValueError(f"fixed policy: rounding must be 'floor', 'ceil' or 'round', got {rounding!r}")

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        shape = x.shape[:2] if self.per_token else x.shape[:1]
        s = torch.full(shape, float(self.fraction), device=x.device)
        k = budget_k(s, self.num_heads, self.k_min, self.rounding)  # type: ignore[arg-type]
        cap = self._cap  # budget_k_bound of the options, kept by __setattr__: a host int, specialised by compile
        return Budget(s=s, k=k, k_cap=cap, k_floor=cap)  # every row's k is this one number
