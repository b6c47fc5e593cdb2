"""The budget rule (k = clamp(floor(s * H), k_min, H)) and the plan constructors every router shares."""

from __future__ import annotations

import pytest
import torch
from condcomp.policies.fixed import FixedPolicy

import condcomp
from condcomp.plans import budget_k, kv_groups_used, plan_top_k


@pytest.mark.parametrize(
    ("s", "H", "k_min", "rounding", "want"),
    [
        (0.085, 8, 1, "floor", 1),  # floor gives 0: the clamp makes BudgetFormer's DBpedia budget one head
        (0.085, 8, 0, "floor", 0),  # k_min = 0 allows no head at all
        (0.0, 8, 1, "floor", 1),
        (0.0, 8, 0, "floor", 0),
        (0.5, 8, 1, "floor", 4),
        (0.99, 8, 1, "floor", 7),
        (1.0, 8, 1, "floor", 8),
        (0.3, 10, 1, "floor", 3),  # 0.3 * 10 = 3.0000000000000004 in floats: still 3
        (0.7, 10, 1, "floor", 7),  # 0.7 * 10 = 6.999999999999999 in floats: still 7
        (0.3, 10, 1, "ceil", 3),
        (0.31, 10, 1, "ceil", 4),
        (0.01, 8, 0, "ceil", 1),
        (0.56, 8, 1, "round", 4),  # 4.48
        (0.57, 8, 1, "round", 5),  # 4.56
        (0.5, 8, 6, "floor", 6),  # k_min above floor(s * H)
    ],
)
def test_budget_rule(s: float, H: int, k_min: int, rounding: str, want: int) -> None:
    k = budget_k(torch.tensor([s]), H, k_min=k_min, rounding=rounding)  # type: ignore[arg-type]
    assert k.dtype == torch.int64
    assert k.tolist() == [want]


def test_budget_rule_keeps_shape_and_ignores_gradient() -> None:
    s = torch.rand(3, 5, requires_grad=True)
    k = budget_k(s, 4)
    assert k.shape == (3, 5) and not k.requires_grad


def test_budget_rule_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match=r"k_min must be in \[0, num_heads=4\]"):
        budget_k(torch.tensor([0.5]), 4, k_min=5)
    with pytest.raises(ValueError, match="rounding must be"):
        budget_k(torch.tensor([0.5]), 4, rounding="up")  # type: ignore[arg-type]


def test_fixed_policy_applies_the_rule_per_example_and_per_token() -> None:
    x = torch.randn(2, 3, 16)
    b = FixedPolicy(num_heads=8, fraction=0.3)(x, None)
    assert b.granularity == "sequence" and b.k.tolist() == [2, 2] and torch.allclose(b.s, torch.full((2,), 0.3))
    b = FixedPolicy(num_heads=8, fraction=0.3, per_token=True)(x, None)
    assert b.granularity == "token" and b.k.shape == (2, 3)
    assert FixedPolicy(num_heads=8, fraction=0.05)(x, None).k.tolist() == [1, 1]
    assert FixedPolicy(num_heads=8, fraction=0.05, k_min=0)(x, None).k.tolist() == [0, 0]
    assert FixedPolicy(num_heads=8, fraction=0.3, rounding="ceil")(x, None).k.tolist() == [3, 3]


def test_k_zero_means_the_attention_output_is_exactly_zero() -> None:
    """k_min = 0 and a zero fraction: no head, no output bias; the residual alone carries the token."""
    layer = condcomp.HeadAttention(16, 4)
    routed = condcomp.RoutedAttention.wrap(
        layer, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.0, "k_min": 0}), router="random"))
    y = routed(torch.randn(2, 5, 16))
    assert torch.equal(y, torch.zeros_like(y))
    usage = routed.head_usage()
    assert usage is not None and usage.k_frac == 0.0 and usage.s_mean == 0.0 and usage.flop_frac == 0.0


def test_plan_top_k_gate_modes() -> None:
    scores = torch.tensor([[0.1, 3.0, 2.0, -1.0]], requires_grad=True)
    probs = torch.softmax(scores.detach(), -1)
    binary = plan_top_k(scores, 2)
    assert binary.active.tolist() == [[False, True, True, False]]
    assert binary.gates.tolist() == [[0.0, 1.0, 1.0, 0.0]] and binary.counts.tolist() == [2]
    assert binary.order.tolist() == [[1, 2, 0, 3]]
    weighted = plan_top_k(scores, 2, gates="weighted")
    torch.testing.assert_close(weighted.gates, probs * binary.active)
    renorm = plan_top_k(scores, 2, gates="renormalized")
    kept = probs * binary.active
    torch.testing.assert_close(renorm.gates, kept / kept.sum() * 2)
    uniform = plan_top_k(torch.zeros(1, 4), 3, gates="renormalized")
    torch.testing.assert_close(uniform.gates, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    hot = plan_top_k(scores, 2, gates="weighted", temperature=0.1)
    torch.testing.assert_close(hot.gates, torch.softmax(scores.detach() / 0.1, -1) * binary.active)


def test_straight_through_has_value_one_and_the_softmax_gradient() -> None:
    scores = torch.randn(2, 5, requires_grad=True)
    plan = plan_top_k(scores, torch.tensor([2, 3]), straight_through=True)
    torch.testing.assert_close(plan.gates, plan.active.float())
    probe = torch.randn(2, 5)
    (g,) = torch.autograd.grad((plan.gates * probe).sum(), [scores])
    s2 = scores.detach().requires_grad_()
    (want,) = torch.autograd.grad((torch.softmax(s2, -1) * probe * plan.active).sum(), [s2])
    torch.testing.assert_close(g, want)


def test_plan_top_k_token_mask_gives_padding_no_heads() -> None:
    scores = torch.randn(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    plan = plan_top_k(scores, 2, mask=mask)
    assert plan.granularity == "token"
    assert plan.counts.tolist() == [[2, 2, 0], [2, 0, 0]]
    with pytest.raises(ValueError, match="per-token scores"):
        plan_top_k(torch.randn(2, 4), 2, mask=mask)


def test_plan_constructors_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="temperature must be positive"):
        plan_top_k(torch.randn(2, 4), 2, temperature=0.0)
    with pytest.raises(ValueError, match="gates must be"):
        plan_top_k(torch.randn(2, 4), 2, gates="soft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must match the score rows"):
        plan_top_k(torch.randn(2, 4), torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="bool tensor"):
        condcomp.plan_from_active(torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\(B, H\) or \(B, T, H\)"):
        condcomp.plan_from_active(torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="same shape"):
        condcomp.plan_from_active(torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 3))


def test_full_plan() -> None:
    p = condcomp.full_plan(2, 3, torch.device("cpu"))
    assert p.granularity == "sequence" and p.gates.tolist() == [[1.0] * 3] * 2 and p.counts.tolist() == [3, 3]
    p = condcomp.full_plan(2, 3, torch.device("cpu"), tokens=4)
    assert p.granularity == "token" and p.gates.shape == (2, 4, 3)


def test_with_aux_merges_losses() -> None:
    p = condcomp.plan_from_active(torch.ones(1, 2, dtype=torch.bool), aux_losses={"a": torch.tensor(1.0)})
    q = p.with_aux({"b": torch.tensor(2.0), "a": torch.tensor(3.0)})
    assert {k: float(v) for k, v in q.aux_losses.items()} == {"a": 3.0, "b": 2.0}
    assert float(p.aux_losses["a"]) == 1.0  # frozen: the original is untouched


def test_kv_groups_used_by_hand() -> None:
    """8 query heads over 4 KV groups (heads 2g and 2g+1 read group g), checked against groups written out."""
    T, F = True, False
    sequence = torch.tensor([[T, F, F, F, F, F, F, T],   # heads 0 and 7: groups 0 and 3
                             [F, F, F, T, T, F, F, F],   # heads 3 and 4: groups 1 and 2
                             [F, F, F, F, F, F, F, F]])  # no head (k = 0): no group
    assert kv_groups_used(sequence, 4).tolist() == [[T, F, F, T], [F, T, T, F], [F, F, F, F]]
    assert kv_groups_used(sequence, 1).tolist() == [[T], [T], [F]]  # multi-query: one group
    assert torch.equal(kv_groups_used(sequence, 8), sequence)  # no grouping: each head its own group
    token = torch.stack([sequence, sequence.roll(1, dims=-1)], dim=1)  # (B, T=2, H): heads shifted by one
    assert kv_groups_used(token, 4)[:, 1].tolist() == [[T, F, F, F], [F, F, T, F], [F, F, F, F]]  # 0+1, 4+5
    with pytest.raises(ValueError, match="do not split into 3"):
        kv_groups_used(sequence, 3)


@pytest.mark.parametrize("rounding", ["floor", "ceil", "round"])
def test_budget_k_gives_the_exact_count_for_every_fraction_whose_count_is_whole(rounding: str) -> None:
    """Red team round 5: a float32 s of 31/56 times 112 heads is 61.99999..., and floor gave 61 heads, not 62 (any
    H >= 67 had such fractions). Oracle: integer arithmetic, for every num/den <= 1 with num * H / den whole."""
    for H in range(1, 129):
        cases = [(num, den) for den in range(1, H + 1) for num in range(den + 1) if num * H % den == 0]
        s = torch.tensor([num / den for num, den in cases])
        want = [num * H // den for num, den in cases]
        assert budget_k(s, H, k_min=0, rounding=rounding).tolist() == want, H  # type: ignore[arg-type]
