"""A study variant of BudgetFormer's policy whose budget learns from the *direction* of each example's pull only.

Measured on trained models (``results/budget_search/gradients.py``): the task loss's per-example gradient with
respect to s points towards more heads on most examples and grows with difficulty, except on the hardest fifth,
where it is large and points towards fewer heads; its heavy tail outweighs the rest, so the budget network
learns to give hard-looking inputs fewer heads. ``budgetformer_signed`` keeps the paper's policy and loss and
replaces, in training, each example's gradient on s by its sign times the batch's mean magnitude: every example
then counts the same whatever its loss. Evaluation is unchanged. It is registered (:func:`register`) only by a
run that asks for it (``method_options={"policy": ["budgetformer_signed", {...}]}``), so the library's list of
policies stays the library's.
"""

from __future__ import annotations

from condcomp.policies.budgetformer import BudgetFormerPolicy
from torch import Tensor

from condcomp.registry import register_policy
from condcomp.types import Budget


class SignedPullBudgetPolicy(BudgetFormerPolicy):
    """:class:`BudgetFormerPolicy` whose s receives ``sign(g_i) * mean_j |g_j|`` instead of ``g_i`` in training."""

    label = "budgetformer_signed policy"

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        budget = super().forward(x, mask)
        if self.training and budget.s.requires_grad:
            budget.s.register_hook(lambda g: g.sign() * g.abs().mean())
        return budget


NAME = "budgetformer_signed"


def register() -> None:
    """Register the policy as ``budgetformer_signed`` (once per process)."""
    from condcomp.registry import POLICIES

    if NAME not in POLICIES.names():
        register_policy(NAME)(SignedPullBudgetPolicy)
