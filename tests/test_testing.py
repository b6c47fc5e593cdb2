"""``condcomp.testing``: a user's own router or policy passes the contract, and each way of breaking it fails
with a message that names the component and what is wrong.

Every broken component below differs from a working one (``GoodRouter``/``GoodPolicy``) in one place, so each
test shows that one check can fail (test_components.py shows that every built-in passes them all).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import condcomp
from condcomp.testing import check_policy, check_router

pytestmark = pytest.mark.usefixtures("restore_registries")


class GoodRouter(nn.Module):
    """A learned per-example scorer: mean of the real tokens, a linear score per head, the budget's k heads."""

    granularity = "sequence"

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.score = nn.Linear(d_model, num_heads)

    def scores(self, x: Tensor, mask: Tensor | None) -> Tensor:
        m = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask  # (B, T)
        pooled = (x.float() * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1)  # (B, D)
        return self.score(pooled)  # (B, H)

    def forward(self, x: Tensor, mask: Tensor | None, budget: condcomp.Budget,
                attn: condcomp.AttentionWeights) -> condcomp.HeadPlan:
        return condcomp.plan_top_k(self.scores(x, mask), budget.k, gates="weighted")


class GoodPolicy(nn.Module):
    """A learned per-example budget: sigmoid of a linear read of the masked mean."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.read, self.num_heads = nn.Linear(d_model, 1), num_heads

    def forward(self, x: Tensor, mask: Tensor | None) -> condcomp.Budget:
        m = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask  # (B, T)
        pooled = (x.float() * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp(min=1)  # (B, D)
        s = torch.sigmoid(self.read(pooled)).squeeze(-1)  # (B,)
        return condcomp.Budget(s=s, k=condcomp.budget_k(s, self.num_heads))


def registered_router(name: str, forward: Any = None, **attrs: Any) -> type:
    """A subclass of GoodRouter with one method or attribute replaced, registered under ``name``."""
    body = dict(attrs, **({"forward": forward} if forward else {}))
    return condcomp.register_router(name)(type(name, (GoodRouter,), body))


def test_a_working_router_and_policy_pass_by_class_or_name() -> None:
    router = condcomp.register_router("test_good")(type("TestGood", (GoodRouter,), {}))
    policy = condcomp.register_policy("test_good")(type("TestGoodPolicy", (GoodPolicy,), {}))
    check_router(router)
    check_router("test_good")
    check_policy(policy)
    check_policy("test_good")


def test_nan_gates_are_refused() -> None:
    def forward(self: Any, x: Tensor, mask: Any, budget: Any, attn: Any) -> condcomp.HeadPlan:
        plan = GoodRouter.forward(self, x, mask, budget, attn)
        return condcomp.plan_from_active(plan.active, plan.gates.masked_fill(plan.active, float("nan")))

    registered_router("test_nan", forward)
    with pytest.raises(AssertionError, match=r"router 'test_nan'.*non-finite gates"):
        check_router("test_nan")


def test_gates_of_the_wrong_shape_are_refused() -> None:
    def forward(self: Any, x: Tensor, mask: Any, budget: Any, attn: Any) -> condcomp.HeadPlan:
        per_token = self.scores(x, mask).unsqueeze(1).expand(-1, x.shape[1], -1)  # (B, T, H): not a sequence plan
        return condcomp.plan_top_k(per_token, budget.k.unsqueeze(1).expand(-1, x.shape[1]))

    registered_router("test_shape", forward)
    with pytest.raises(AssertionError, match=r"router 'test_shape'.*(granularity|expected \(3, 8\))"):
        check_router("test_shape")


def test_a_parameter_without_a_gradient_is_named_unless_declared() -> None:
    def forward(self: Any, x: Tensor, mask: Any, budget: Any, attn: Any) -> condcomp.HeadPlan:
        return condcomp.plan_top_k(self.scores(x, mask), budget.k, gates="binary")  # binary: no gradient at all

    registered_router("test_nograd", forward)
    with pytest.raises(AssertionError, match=r"parameters \['score.weight', 'score.bias'\] received no gradient"):
        check_router("test_nograd")
    registered_router("test_declared", forward, non_trainable=("score.weight", "score.bias"))
    check_router("test_declared")  # declared non-trainable: accepted


def test_a_router_that_ignores_the_budget_is_refused() -> None:
    def forward(self: Any, x: Tensor, mask: Any, budget: Any, attn: Any) -> condcomp.HeadPlan:
        return condcomp.plan_top_k(self.scores(x, mask), torch.full_like(budget.k, 2), gates="weighted")

    registered_router("test_fixed_two", forward)
    with pytest.raises(AssertionError, match=r"ran \[2, 2, 2\] heads where the budget allowed k = 0"):
        check_router("test_fixed_two")


def test_a_router_whose_padding_votes_is_refused() -> None:
    def forward(self: Any, x: Tensor, mask: Any, budget: Any, attn: Any) -> condcomp.HeadPlan:
        return condcomp.plan_top_k(self.score(x.float().mean(1)), budget.k, gates="weighted")  # padding counted

    registered_router("test_padding", forward)
    with pytest.raises(AssertionError, match="changed with what padded tokens hold"):
        check_router("test_padding")


def test_a_crash_is_reported_with_where_it_happened() -> None:
    def forward(self: Any, x: Tensor, mask: Any, budget: Any, attn: Any) -> condcomp.HeadPlan:
        raise RuntimeError("boom")

    registered_router("test_crash", forward)
    with pytest.raises(AssertionError, match=r"router 'test_crash': forward raised RuntimeError: boom"):
        check_router("test_crash")


def test_a_policy_with_k_out_of_range_or_s_above_one_is_refused() -> None:
    def wide_k(self: Any, x: Tensor, mask: Any) -> condcomp.Budget:
        b = GoodPolicy.forward(self, x, mask)
        return condcomp.Budget(s=b.s, k=b.k + self.num_heads)

    def big_s(self: Any, x: Tensor, mask: Any) -> condcomp.Budget:
        b = GoodPolicy.forward(self, x, mask)
        return condcomp.Budget(s=b.s * 3, k=b.k)

    condcomp.register_policy("test_wide_k")(type("WideK", (GoodPolicy,), {"forward": wide_k}))
    condcomp.register_policy("test_big_s")(type("BigS", (GoodPolicy,), {"forward": big_s}))
    with pytest.raises(AssertionError, match=r"policy 'test_wide_k': k must be int64 in \[0, 8\]"):
        check_policy("test_wide_k")
    with pytest.raises(AssertionError, match=r"policy 'test_big_s': s must be finite and in \[0, 1\]"):
        check_policy("test_big_s")


def test_a_policy_whose_declared_bounds_its_k_breaks_is_refused() -> None:
    """``k_cap`` / ``k_floor`` size the gathered executor's capturable paths: a bound k leaves is a wrong answer."""
    def low_cap(self: Any, x: Tensor, mask: Any) -> condcomp.Budget:
        b = GoodPolicy.forward(self, x, mask)
        return condcomp.Budget(s=b.s, k=torch.full_like(b.k, 5), k_cap=4)

    def high_floor(self: Any, x: Tensor, mask: Any) -> condcomp.Budget:
        b = GoodPolicy.forward(self, x, mask)
        return condcomp.Budget(s=b.s, k=torch.full_like(b.k, 3), k_cap=8, k_floor=8)

    condcomp.register_policy("test_low_cap")(type("LowCap", (GoodPolicy,), {"forward": low_cap}))
    condcomp.register_policy("test_high_floor")(type("HighFloor", (GoodPolicy,), {"forward": high_floor}))
    with pytest.raises(AssertionError, match="declared k_cap = 4 but k reaches 5"):
        check_policy("test_low_cap")
    with pytest.raises(AssertionError, match="declared k_floor = 8 but k falls to 3"):
        check_policy("test_high_floor")


def test_an_unregistered_class_or_unknown_name_says_how_to_register() -> None:
    with pytest.raises(TypeError, match=r"condcomp.register_router\(\"name\"\)"):
        check_router(GoodRouter)
    with pytest.raises(KeyError, match="unknown router 'nope'"):
        check_router("nope")
