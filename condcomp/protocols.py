"""The three roles as structural protocols: third-party components need not inherit from anything."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from condcomp.types import AttentionInputs, AttentionWeights, Budget, Granularity, HeadPlan


@runtime_checkable
class BudgetPolicy(Protocol):
    """Decides how many heads each row may use: ``(x (B, T, D), mask (B, T) | None) -> Budget``."""

    def __call__(self, x: Tensor, mask: Tensor | None) -> Budget: ...


@runtime_checkable
class Router(Protocol):
    """Decides which heads, with what gates: ``(x, mask, budget, attn) -> HeadPlan``.

    ``attn`` is the layer's :class:`~condcomp.AttentionWeights` (``attn.project_queries(x)`` gives queries).
    A router declares ``granularity = "sequence"`` or ``"token"``.
    """

    granularity: Granularity

    def __call__(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan: ...


@runtime_checkable
class Executor(Protocol):
    """Computes attention for a plan; a pure function of (weights, inputs, plan).

    ``supports`` returns None when the executor can run the call, else the reason it cannot.
    """

    name: str

    def supports(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> str | None: ...

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor: ...
