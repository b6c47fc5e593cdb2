"""MoH's router and the parameter-free query-norm router against the paper's equations, worked by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from condcomp.routers.moh import MoHRouter
from condcomp.routers.norm import QueryNormRouter
from torch import nn

import condcomp
from condcomp.types import Budget


def softmax(values: list[float]) -> list[float]:
    e = [math.exp(v) for v in values]
    return [v / sum(e) for v in e]


def full_budget(B: int, H: int) -> Budget:
    return Budget(s=torch.ones(B), k=torch.full((B,), H))


def worked_router(gate_norm: str) -> MoHRouter:
    """H = 5 heads: h_s = 2 shared, E = 3 routed, Top-2; D = 2 with hand-set W_s, W_r, W_h."""
    r = MoHRouter(d_model=2, num_heads=5, shared_heads=2, top_k=2, gate_norm=gate_norm)
    with torch.no_grad():
        r.w_s.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))  # type: ignore[union-attr]
        r.w_r.weight.copy_(torch.tensor([[1.0, 1.0], [2.0, -1.0], [-1.0, 0.5]]))  # type: ignore[union-attr]
        r.w_h.weight.copy_(torch.tensor([[0.5, 0.0], [0.0, -0.5]]))  # type: ignore[union-attr]
    return r.eval()


@pytest.mark.parametrize("gate_norm", ["paper", "released"])
def test_moh_gates_match_the_equations_on_a_worked_example(gate_norm: str) -> None:
    x = torch.tensor([[[1.0, 2.0]]])  # one token
    plan = worked_router(gate_norm)(x, None, full_budget(1, 5), None)
    # W_s x = (1, 2); W_r x = (3, 0, 0); W_h x = (0.5, -1)
    shared = softmax([1.0, 2.0])
    routed = softmax([3.0, 0.0, 0.0])  # Top-2: head 0 (3.0) and head 1 (tie with head 2: lower index wins)
    a1, a2 = softmax([0.5, -1.0])
    if gate_norm == "paper":
        want = [a1 * shared[0], a1 * shared[1], a2 * routed[0], a2 * routed[1], 0.0]
    else:  # renormalised over the Top-2, times K = 2; shared times h_s = 2; stage weights times 2
        kept = routed[0] + routed[1]
        want = [2 * a1 * 2 * shared[0], 2 * a1 * 2 * shared[1], 2 * a2 * 2 * routed[0] / kept,
                2 * a2 * 2 * routed[1] / kept, 0.0]
    assert plan.granularity == "token"
    assert plan.active[0, 0].tolist() == [True, True, True, True, False]
    torch.testing.assert_close(plan.gates[0, 0], torch.tensor(want), atol=1e-6, rtol=1e-5)


def test_released_normalisation_gives_unit_gates_at_uniform_routing() -> None:
    r = MoHRouter(d_model=4, num_heads=8, shared_heads=2, top_k=3).eval()
    for p in r.parameters():
        nn.init.zeros_(p)
    plan = r(torch.randn(2, 3, 4), None, full_budget(2, 8), None)
    assert torch.allclose(plan.gates[plan.active], torch.ones(()))


def test_binary_gates_are_exact_and_straight_through() -> None:
    weighted = worked_router("released").train()
    binary = worked_router("released").train()
    binary.gates = "binary"
    x = torch.tensor([[[1.0, 2.0], [-0.5, 0.3]]])
    pw = weighted(x, None, full_budget(1, 5), None)
    pb = binary(x, None, full_budget(1, 5), None)
    assert torch.equal(pb.gates.detach(), pb.active.float())
    probe = torch.randn(1, 2, 5)
    (pw.gates * probe).sum().backward()
    (pb.gates * probe).sum().backward()
    for (name, p), q in zip(weighted.named_parameters(), binary.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=f"straight-through gradient of {name}")
    binary.eval()
    assert torch.equal(binary(x, None, full_budget(1, 5), None).gates, pb.active.float())


def test_padding_tokens_get_no_heads_and_are_left_out_of_load_balance() -> None:
    r = MoHRouter(d_model=4, num_heads=6, shared_heads=2, top_k=2)
    x = torch.randn(2, 4, 4)
    mask = torch.tensor([[True, True, False, False], [True] * 4])
    plan = r(x, mask, full_budget(2, 6), None)
    assert plan.counts[0, 2:].tolist() == [0, 0] and bool((plan.counts[mask] == 4).all())
    x2 = x.clone()
    x2[0, 2:] = 50.0
    torch.testing.assert_close(r(x2, mask, full_budget(2, 6), None).aux_losses["load_balance"],
                               plan.aux_losses["load_balance"])


@pytest.mark.parametrize("router", [("moh", {"shared_heads": 3, "top_k": 5, "gates": "binary"}),
                                    ("norm", {"shared_heads": 2, "top_k": 6})])
def test_full_budget_with_every_routed_head_reproduces_the_layer(router: Any) -> None:
    layer = condcomp.HeadAttention(16, 8).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    want = layer(x, mask=mask)
    routed = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig("full", router, executor="masked"))
    got = routed.eval()(x, mask)
    plan = routed.last.plan  # type: ignore[union-attr]
    assert torch.equal(plan.gates[mask], torch.ones(int(mask.sum()), 8))
    torch.testing.assert_close(got[mask], want[mask], atol=1e-12, rtol=1e-10)


def test_budget_composition_sets_routed_heads_per_example() -> None:
    r = MoHRouter(d_model=4, num_heads=8, shared_heads=2, top_k=3).eval()
    # k counts all heads: full (8) -> the configured top_k = 3 routed; 6 -> 6 - 2 = 4 routed; 1 and 2 -> none
    # routed (the 2 shared heads stay on even when k < h_s)
    k = torch.tensor([8, 6, 1, 2])
    plan = r(torch.randn(4, 3, 4), None, Budget(s=k / 8, k=k), None)
    assert plan.counts.tolist() == [[5] * 3, [6] * 3, [2] * 3, [2] * 3]


def test_learned_budget_reaches_f_theta_through_moh() -> None:
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {"budget_weight": 0.0}),
                                  router=("moh", {"shared_heads": 2, "top_k": 3, "load_balance": 0.0}),
                                  executor="masked")
    routed = condcomp.RoutedAttention.wrap(condcomp.HeadAttention(16, 8), cfg).train()
    routed(torch.randn(3, 5, 16)).square().mean().backward()
    for name, p in routed.condcomp_policy.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, f"f_theta.{name} got no task gradient"


def test_norm_router_picks_the_largest_query_norms() -> None:
    attn = condcomp.HeadAttention(8, 4)  # Dh = 2
    r = QueryNormRouter(num_heads=4, shared_heads=1, top_k=2).eval()
    x = torch.randn(2, 3, 8)
    plan = r(x, None, full_budget(2, 4), attn.weights())
    q = x @ attn.q_proj.weight.detach().T + attn.q_proj.bias.detach()  # (B, T, 8)
    for b in range(2):
        for t in range(3):
            norms = [float(q[b, t, 2 * h:2 * h + 2].norm()) for h in range(1, 4)]
            best = sorted(range(3), key=lambda i: -norms[i])[:2]
            assert plan.active[b, t].tolist() == [True] + [i in best for i in range(3)]
    assert torch.equal(plan.gates, plan.active.float())
    assert list(r.parameters()) == []


def test_norm_router_straight_through_reaches_the_query_projection() -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5, "per_token": True}),
                                  router=("norm", {"shared_heads": 1}), executor="masked")
    layer = condcomp.HeadAttention(8, 4)
    routed = condcomp.RoutedAttention.wrap(layer, cfg).train()
    x = torch.randn(2, 3, 8)
    y = routed(x)
    plan = routed.last.plan  # type: ignore[union-attr]
    assert torch.equal(plan.gates, plan.active.float()) and plan.counts.unique().tolist() == [2]
    # The gradient of W_q through the router is the difference from the same plan without straight-through.
    y.square().sum().backward()
    with_st = layer.q_proj.weight.grad.clone()  # type: ignore[union-attr]
    layer.q_proj.weight.grad = None
    routed.condcomp_router.straight_through = False
    torch.manual_seed(0)
    routed(x).square().sum().backward()
    assert not torch.allclose(with_st, layer.q_proj.weight.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize("router, message", [
    (("moh", {"shared_heads": 0, "top_k": 0}), "top_k = 0 with no shared heads"),
    (("norm", {"shared_heads": 0, "top_k": 0}), "top_k = 0 with no shared heads"),
    (("moh", {"shared_heads": -1}), "moh router: shared_heads .* must be a whole number >= 0"),
    (("moh", {"gate_norm": "mine"}), "gate_norm"),
    (("moh", {"load_balance": -0.01}), "load_balance"),
])
def test_bad_moh_options_fail_at_config_time(router: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        condcomp.CondCompConfig("full", router)


def test_too_many_heads_fail_when_the_layer_is_known() -> None:
    cfg = condcomp.CondCompConfig("full", ("moh", {"shared_heads": 3, "top_k": 6}))
    with pytest.raises(ValueError, match=r"shared_heads \+ top_k = 3 \+ 6 exceeds the layer's 8 heads"):
        condcomp.apply_(nn.Sequential(condcomp.HeadAttention(16, 8)), cfg)


def test_k_may_differ_per_layer_by_wrapping_layers_one_by_one() -> None:
    model = nn.Sequential(condcomp.HeadAttention(16, 8), condcomp.HeadAttention(16, 8))
    for i, K in enumerate((1, 4)):
        cfg = condcomp.CondCompConfig("full", ("moh", {"shared_heads": 2, "top_k": K}), executor="masked")
        model[i] = condcomp.RoutedAttention.wrap(model[i], cfg)
    model.eval()
    model(torch.randn(2, 3, 16))
    usage = condcomp.head_usage(model)
    assert usage["0"].k_frac == pytest.approx(3 / 8) and usage["1"].k_frac == pytest.approx(6 / 8)
    assert set(condcomp.remove_(model)) == {"0", "1"}
