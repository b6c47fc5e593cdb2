"""The methods' formulas against small computations written out by hand: schedules, budget hinge, entropy term,
load balance, and the soft top-k relaxation."""

from __future__ import annotations

import math

import pytest
import torch
from condcomp.policies.budgetformer import BudgetFormerPolicy, budget_hinge
from condcomp.routers.moh import MoHRouter, load_balance_loss
from condcomp.routers.topk import TopKRouter

import condcomp
from condcomp.relaxations import entropy, soft_ranks, soft_threshold, soft_topk_mask
from condcomp.schedules import Constant, Cosine, Exponential, Linear, make_schedule
from condcomp.types import Budget

# ---------------------------------------------------------------- schedules


def test_schedule_values_by_hand() -> None:
    assert Constant(0.3)(0.0) == Constant(0.3)(1.0) == 0.3
    lin = Linear(2.0, 0.1)
    assert lin(0.0) == 2.0 and lin(1.0) == pytest.approx(0.1) and lin(0.5) == pytest.approx(1.05)
    cos = Cosine(1.0, 0.0)
    assert cos(0.0) == 1.0 and cos(1.0) == pytest.approx(0.0)
    assert cos(0.5) == pytest.approx(0.5) and cos(0.25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    exp = Exponential(2.0, 0.5)
    assert exp(0.0) == 2.0 and exp(1.0) == pytest.approx(0.5) and exp(0.5) == pytest.approx(1.0)  # sqrt(2 * 0.5)


def test_schedule_specs_round_trip_and_errors() -> None:
    for sched in (Constant(0.2), Linear(-0.01, 0.01), Cosine(3.0, 1.0), Exponential(1.0, 0.1)):
        spec = sched.to_spec()
        assert make_schedule(spec) == sched
        assert make_schedule(dict(spec))(0.3) == sched(0.3)
    assert make_schedule(0.7) == Constant(0.7)
    with pytest.raises(ValueError, match="kind"):
        make_schedule({"kind": "step", "start": 1.0})
    with pytest.raises(ValueError, match="takes"):
        make_schedule({"kind": "linear", "begin": 1.0, "end": 0.0})
    with pytest.raises(ValueError, match="same sign"):
        Exponential(-0.01, 0.01)
    with pytest.raises(ValueError, match=r"progress must be in \[0, 1\]"):
        Linear(0.0, 1.0)(1.5)
    with pytest.raises(TypeError, match="schedule"):
        make_schedule("fast")


# ---------------------------------------------------------------- budget hinge


@pytest.mark.parametrize("s, expected", [
    (0.1, 0.0), (0.5, 0.0), (0.9, 0.0),  # inside [0.1, 0.9] (ends included): zero
    (0.05, 0.05**2), (0.0, 0.1**2),  # below: (s_min - s)^2
    (0.95, 0.05**2), (1.0, 0.1**2),  # above: (s - s_max)^2
])
def test_hinge_zero_inside_quadratic_outside(s: float, expected: float) -> None:
    assert float(budget_hinge(torch.tensor([s]), 0.1, 0.9)) == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_policy_returns_weighted_mean_hinge_of_its_own_s() -> None:
    policy = BudgetFormerPolicy(d_model=8, num_heads=4, s_min=0.4, s_max=0.45, budget_weight=3.0)
    with torch.no_grad():
        policy.mlp.fc2.bias.fill_(0.0)
        policy.mlp.fc2.weight.mul_(40.0)  # spread s over (0, 1) so some rows fall on each side of the interval
    x = torch.randn(16, 5, 8)
    budget = policy(x, None)
    s = budget.s.detach().tolist()
    by_hand = sum(max(0.4 - v, 0.0) ** 2 + max(v - 0.45, 0.0) ** 2 for v in s) / len(s)
    assert any(v < 0.4 for v in s) and any(v > 0.45 for v in s)
    assert budget.aux_losses["budget"].item() == pytest.approx(3.0 * by_hand, rel=1e-5)
    assert budget.k.tolist() == [max(1, min(4, math.floor(v * 4 + 1e-6))) for v in s]


def test_policy_pools_only_real_tokens_and_starts_at_init_s() -> None:
    policy = BudgetFormerPolicy(d_model=8, num_heads=8, init_s=0.6)
    x = torch.randn(2, 6, 8)
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    x_changed = x.clone()
    x_changed[1, 3:] = 100.0  # padding content must not matter
    assert torch.equal(policy(x, mask).s, policy(x_changed, mask).s)
    s = policy(torch.randn(64, 6, 8), None).s
    assert float((s.detach() - 0.6).abs().max()) < 0.1  # small last layer: every input starts near init_s, no collapse


def test_bad_budget_options_are_rejected_at_config_time() -> None:
    with pytest.raises(ValueError, match="s_min=0.8 is greater than s_max=0.2"):
        condcomp.CondCompConfig(policy=("budgetformer", {"s_min": 0.8, "s_max": 0.2}))
    with pytest.raises(ValueError, match=r"s_max .* must be a finite number >= 0 and <= 1"):
        condcomp.CondCompConfig(policy=("budgetformer", {"s_max": 1.5}))
    with pytest.raises(ValueError, match="init_s"):
        condcomp.CondCompConfig(policy=("budgetformer_token", {"init_s": 1.0}))
    with pytest.raises(ValueError, match="budget_weight"):
        condcomp.CondCompConfig(policy=("budgetformer", {"budget_weight": -1.0}))


# ---------------------------------------------------------------- entropy term and its schedule


def test_entropy_term_follows_beta_schedule() -> None:
    torch.manual_seed(1)
    D, H = 6, 4
    router = TopKRouter(d_model=D, num_heads=H, temperature={"kind": "exponential", "start": 2.0, "end": 0.5},
                        entropy_beta={"kind": "linear", "start": -0.02, "end": 0.04}).eval()
    x = torch.randn(3, 5, D)
    W, b = router.scorer.weight.detach(), router.scorer.bias.detach()
    budget = Budget(s=torch.full((3,), 0.5), k=torch.full((3,), 2))
    values = []
    for p in (0.0, 0.5, 1.0):
        router.set_progress(p)
        aux = router(x, None, budget, None).aux_losses["entropy"].detach()
        tau = 2.0 * (0.25**p)  # exponential 2 -> 0.5
        beta = -0.02 + 0.06 * p
        z = x.mean(1) @ W.T + b  # (B, H): the linear scorer on the pooled input
        probs = torch.softmax(z / tau, dim=-1)
        h = -(probs * probs.log()).sum(-1).mean()
        assert float(aux) == pytest.approx(beta * float(h), rel=1e-5, abs=1e-8)
        values.append(float(aux))
    assert values[0] < 0 < values[2]  # rewards entropy early (negative loss), penalises it late


def test_entropy_ignores_padding_tokens() -> None:
    probs = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    assert float(entropy(probs)) == pytest.approx(math.log(2) / 2)
    assert float(entropy(probs, torch.tensor([[True, False]]))) == pytest.approx(math.log(2))


# ---------------------------------------------------------------- load balance


def _router_with_logits(E: int, K: int) -> MoHRouter:
    return MoHRouter(d_model=E, num_heads=E, shared_heads=0, top_k=K, two_stage=False, load_balance=1.0)


def test_load_balance_is_k_over_e_when_uniform_and_one_when_collapsed() -> None:
    E, K, T = 4, 2, 8
    router = _router_with_logits(E, K)
    budget = Budget(s=torch.ones(1), k=torch.full((1,), E))
    with torch.no_grad():
        router.w_r.weight.zero_()  # uniform probabilities 1/E for every token
    uniform = float(router(torch.randn(1, T, E), None, budget, None).aux_losses["load_balance"].detach())
    assert uniform == pytest.approx(K / E)
    with torch.no_grad():
        router.w_r.weight.copy_(torch.eye(E) * 30.0)  # logits = 30 * x: one-hot inputs pick their head
    # Collapse: every token prefers heads 0 and 1.
    x = torch.tensor([[20.0, 19.0, 0.0, 0.0]]).expand(1, T, E)
    collapsed = float(router(x, None, budget, None).aux_losses["load_balance"].detach())
    # by hand: f = (1, 1, 0, 0); P ~ (softmax(600, 570, 0, 0)) -> (1, ~0, 0, 0): sum f_i P_i ~ 1
    assert collapsed == pytest.approx(1.0, abs=1e-6)
    # Balanced and confident: half the tokens on heads {0, 1}, half on {2, 3}: f_i = 1/2, P_i = 1/4 -> K / E.
    x = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]).repeat(T // 2, 1).unsqueeze(0)
    balanced = float(router(x, None, budget, None).aux_losses["load_balance"].detach())
    assert balanced == pytest.approx(K / E, abs=1e-6)
    assert uniform < collapsed and balanced < collapsed


def test_load_balance_by_hand_and_padding() -> None:
    probs = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.9, 0.05, 0.05]]])
    sel = torch.tensor([[[True, False, False], [False, False, True], [True, False, False]]])
    rows = torch.tensor([[True, True, False]])  # the third token is padding
    f = [0.5, 0.0, 0.5]
    P = [(0.7 + 0.1) / 2, (0.2 + 0.3) / 2, (0.1 + 0.6) / 2]
    assert float(load_balance_loss(probs, sel, rows)) == pytest.approx(sum(a * b for a, b in zip(f, P)))


# ---------------------------------------------------------------- soft top-k relaxation


def test_soft_mask_crosses_one_half_between_kept_and_dropped_heads() -> None:
    logits = torch.tensor([[3.0, -20.0, 10.0, 0.0, -5.0]])  # hard ranks (1-based): 2, 5, 1, 3, 4
    rho = soft_ranks(logits)
    assert torch.allclose(rho, torch.tensor([[2.0, 5.0, 1.0, 3.0, 4.0]]), atol=0.06)
    H = 5
    for s in (0.2, 0.39, 0.5, 0.79, 0.99):
        k = torch.tensor([math.floor(s * H + 1e-6)])
        b = soft_threshold(torch.tensor([s]), k, H)
        assert b.item() == k.item() + 0.5
        m = soft_topk_mask(logits, b, tau=0.25)
        kept = m[0] > 0.5
        hard_rank = torch.tensor([2, 5, 1, 3, 4])
        assert torch.equal(kept, hard_rank <= k.item()), (s, m)


def test_soft_threshold_carries_gradient_h_to_s() -> None:
    s = torch.tensor([0.37], requires_grad=True)
    b = soft_threshold(s, torch.tensor([2]), 8)  # 0.37 * 8 = 2.96 -> k = 2, b = 2.5
    assert b.item() == 2.5
    b.sum().backward()
    assert float(s.grad) == pytest.approx(8.0)  # type: ignore[arg-type]
