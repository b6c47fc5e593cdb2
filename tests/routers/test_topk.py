"""BudgetFormer's policy + topk router: eval = deterministic hard top-k, training = differentiable in s and scores,
parity at full budget, per-token budgets, and clear errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from condcomp.routers.topk import TRAIN_MODES, TopKRouter
from torch import nn

import condcomp
from condcomp.types import Budget

D, H = 16, 8


def stack(cfg: condcomp.CondCompConfig, layers: int = 2) -> nn.Sequential:
    model = nn.Sequential(*[condcomp.HeadAttention(D, H) for _ in range(layers)])
    condcomp.apply_(model, cfg)
    return model


def run(model: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    for layer in model:
        x = layer(x, mask=mask)
    return x


def test_eval_is_deterministic_hard_top_k_of_the_clean_scores() -> None:
    router = TopKRouter(d_model=D, num_heads=H, noise_std=5.0, gates="weighted").eval()
    router.set_progress(0.5)
    x = torch.randn(4, 6, D)
    budget = Budget(s=torch.tensor([0.1, 0.3, 0.6, 1.0]), k=torch.tensor([1, 2, 4, 8]))
    a, b = router(x, None, budget, None), router(x, None, budget, None)
    assert torch.equal(a.gates, b.gates) and torch.equal(a.active, b.active)
    z = x.mean(1) @ router.scorer.weight.detach().T + router.scorer.bias.detach()  # (B, H), no noise
    tau = 2.0 * 0.25**0.5  # default temperature: exponential 2 -> 0.5
    for row, k in enumerate([1, 2, 4, 8]):
        top = set(torch.topk(z[row], k).indices.tolist())
        assert set(a.active[row].nonzero().flatten().tolist()) == top
        probs = torch.softmax(z[row] / tau, -1)
        for h in range(H):
            assert a.gates[row, h].item() == pytest.approx(float(probs[h]) if h in top else 0.0, rel=1e-5)


def test_training_draws_noise_eval_does_not() -> None:
    router = TopKRouter(d_model=D, num_heads=H, noise_std=1.0)
    x = torch.randn(4, 6, D)
    budget = Budget(s=torch.full((4,), 0.5), k=torch.full((4,), 4))
    e1 = router(x, None, budget, None).aux_losses["entropy"]
    e2 = router(x, None, budget, None).aux_losses["entropy"]
    assert not torch.equal(e1, e2)


@pytest.mark.parametrize("gates", ["binary", "weighted", "renormalized"])
def test_full_budget_eval_selects_every_head_and_binary_reproduces_the_layer(gates: str) -> None:
    layer = condcomp.HeadAttention(D, H).double()
    x = torch.randn(3, 5, D, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [True] * 5])
    want = layer(x, mask=mask)
    routed = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig("full", ("topk", {"gates": gates})))
    routed.eval()
    got = routed(x, mask)
    plan = routed.last.plan  # type: ignore[union-attr]
    assert plan.active.all()
    if gates == "binary":
        assert torch.equal(plan.gates, torch.ones_like(plan.gates))
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    routed.train()  # full budget in training: no choice to make, exact ones too
    routed(x, mask)
    if gates == "binary":
        assert torch.equal(routed.last.plan.gates, torch.ones(3, H, dtype=torch.float32))  # type: ignore[union-attr]


@pytest.mark.parametrize("train_mode", TRAIN_MODES)
def test_full_budget_training_gates_are_exactly_one(train_mode: str) -> None:
    router = TopKRouter(d_model=D, num_heads=H, train_mode=train_mode)  # training mode: noise on
    plan = router(torch.randn(3, 4, D), None, Budget(s=torch.ones(3), k=torch.full((3,), H)), None)
    assert torch.equal(plan.gates, torch.ones(3, H))


@pytest.mark.parametrize("train_mode", TRAIN_MODES)
def test_task_loss_alone_reaches_f_theta_and_g_phi(train_mode: str) -> None:
    # Hinge weight 0 and entropy beta 0: any gradient in the policy or router comes from the task loss.
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {"budget_weight": 0.0}),
                                  router=("topk", {"train_mode": train_mode, "entropy_beta": 0.0}), executor="masked")
    model = stack(cfg).train()
    x = torch.randn(4, 6, D)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2, 4:] = False
    task = run(model, x, mask).square().mean()
    assert float(condcomp.aux_loss(model).detach()) == 0.0
    task.backward()
    for name, routed in condcomp.routed_modules(model).items():
        for role, comp in (("f_theta", routed.condcomp_policy), ("g_phi", routed.condcomp_router)):
            for pname, p in comp.named_parameters():
                assert p.grad is not None and float(p.grad.abs().sum()) > 0, f"{name} {role}.{pname}: no task gradient"


def test_straight_through_forward_value_is_the_hard_top_k() -> None:
    router = TopKRouter(d_model=D, num_heads=H)  # training mode, default straight-through
    x = torch.randn(5, 6, D)
    s = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.99], requires_grad=True)
    k = condcomp.budget_k(s, H)
    plan = router(x, None, Budget(s=s, k=k), None)
    assert plan.active.all()  # training computes every head...
    assert set(plan.gates.detach().unique().tolist()) <= {0.0, 1.0}  # ...but the value is 0/1
    assert torch.equal((plan.gates.detach() > 0).sum(-1), k)
    (plan.gates * torch.randn(5, H)).sum().backward()
    assert s.grad is not None and float(s.grad.abs().sum()) > 0


def test_soft_topk_and_budget_scaled_gates() -> None:
    x = torch.randn(3, 6, D)
    s = torch.tensor([0.25, 0.5, 0.75])
    budget = Budget(s=s, k=condcomp.budget_k(s, H))
    soft = TopKRouter(d_model=D, num_heads=H, train_mode="soft_topk", noise_std=0.0)(x, None, budget, None)
    assert bool(((soft.gates > 0) & (soft.gates < 1)).all())
    scaled_router = TopKRouter(d_model=D, num_heads=H, train_mode="budget_scaled", noise_std=0.0)
    scaled = scaled_router(x, None, budget, None)
    # gate mass = s * H: the budget in heads
    torch.testing.assert_close(scaled.gates.sum(-1), s * H)


def test_per_token_budget_routes_each_token_and_skips_padding() -> None:
    cfg = condcomp.CondCompConfig(policy="budgetformer_token", router="topk", executor="masked")
    model = stack(cfg, layers=1).eval()
    x = torch.randn(2, 5, D)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    run(model, x, mask)
    routed = next(iter(condcomp.routed_modules(model).values()))
    plan = routed.last.plan  # type: ignore[union-attr]
    assert plan.granularity == "token" and plan.gates.shape == (2, 5, H)
    assert int(plan.counts[0, 3:].sum()) == 0 and bool((plan.counts[mask] >= 1).all())
    usage = condcomp.head_usage(model)
    assert 0.0 < next(iter(usage.values())).k_frac <= 1.0


def test_shared_policy_serves_every_layer_and_gets_gradient_from_each() -> None:
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {"budget_weight": 0.0}),
                                  router=("topk", {"entropy_beta": 0.0}), share_policy=True, executor="masked")
    model = stack(cfg, layers=3).train()
    policies = {id(r.condcomp_policy) for r in condcomp.routed_modules(model).values()}
    assert len(policies) == 1
    run(model, torch.randn(2, 4, D)).sum().backward()
    policy = next(iter(condcomp.routed_modules(model).values())).condcomp_policy
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in policy.parameters())


@pytest.mark.parametrize("options, message", [
    ({"temperature": -1.0}, "topk router: temperature .* stay > 0"),
    ({"temperature": {"kind": "linear", "start": 1.0, "end": -0.5}}, "topk router: temperature .* stay > 0"),
    ({"noise_std": -0.1}, "noise_std"),
    ({"train_mode": "gumbel"}, "train_mode"),
    ({"gates": "soft"}, "gates"),
    ({"mask_temperature": 0.0}, "mask_temperature"),
    ({"entropy_beta": {"kind": "exponential", "start": -0.01, "end": 0.01}}, "same sign"),
])
def test_bad_topk_options_are_rejected_at_config_time(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        condcomp.CondCompConfig(policy="budgetformer", router=("topk", options))


def test_config_round_trips_with_schedules() -> None:
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {"s_min": 0.2, "s_max": 0.8}),
                                  router=("topk", {"temperature": {"kind": "cosine", "start": 3.0, "end": 0.3}}))
    assert condcomp.CondCompConfig.from_json(cfg.to_json()) == cfg


def test_methods_md_snippets_run() -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "methods.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) >= 2, "docs/methods.md lost its examples"
    namespace: dict[str, object] = {"__name__": "docs_methods"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/methods.md[{i}]", "exec"), namespace)  # noqa: S102 - our own docs


def test_warm_start_routes_as_static_pruning_of_the_prior_until_trained() -> None:
    """init_scores: at step 0 the plan is the static router's (the prior's top groups, whatever the input);
    the zeroed weights still get gradient, so training can make the plan depend on the input."""
    from condcomp.routers.static import StaticRouter

    heads, kv = 6, 3  # 3 KV groups of 2 query heads
    scores = [0.0, 4.0, 2.0]  # groups ranked 1, 2, 0
    router = TopKRouter(d_model=D, num_heads=heads, kv_groups=True, num_kv_heads=kv, init_scores=scores)
    x = torch.randn(5, 7, D) * 10
    for k in (1, 2, 3):  # k = 2 query heads -> 1 group, ... 6 -> 3 groups
        budget = Budget(s=torch.full((5,), k / 3), k=torch.full((5,), 2 * k))
        static = StaticRouter(heads, heads=[2, 3, 4, 5, 0, 1])(x, None, budget, None)
        plan = router.eval()(x, None, budget, None)
        assert torch.equal(plan.active, static.active)
    router.train()
    budget = Budget(s=torch.full((5,), 1 / 3), k=torch.full((5,), 2))
    gates = router(x, None, budget, None).gates
    (gates * torch.randn_like(gates)).sum().backward()
    assert router.scorer.weight.grad is not None and router.scorer.weight.grad.abs().sum() > 0


def test_warm_start_scores_are_checked() -> None:
    np = pytest.importorskip("numpy")

    def config(scores: Any) -> condcomp.CondCompConfig:
        return condcomp.CondCompConfig(policy="budgetformer", router=("topk", {"init_scores": scores}))

    for scores, error, message in [
        ([1.0, float("nan")], ValueError, "finite"),
        ([0.0, 1e39], ValueError, "finite in float32"),  # a float64 number, inf as the float32 bias
        ("high", TypeError, "got str"),
        (3.0, TypeError, "got float"),
        ({0: 5.0, 1: -5.0}, TypeError, "got dict"),  # its keys would be the scores
        ((v for v in [1.0, 2.0]), TypeError, "got generator"),
        (np.array([0.0, 1.0]), TypeError, r"pass \.tolist\(\)"),
        ([True, False], TypeError, "must hold numbers"),
    ]:
        with pytest.raises(error, match=message):
            config(scores)
    config([np.float32(0.5), 2, 1.5])  # numpy scalars and ints are numbers
    with pytest.raises(ValueError, match="3 scores but the layer has 8 heads"):
        TopKRouter(d_model=D, num_heads=H, init_scores=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"cannot wrap 0: .*3 scores but the layer has 8 heads"):
        stack(condcomp.CondCompConfig(policy="full", router=("topk", {"init_scores": [1.0, 2.0, 3.0]})))
    mlp = TopKRouter(d_model=D, num_heads=H, hidden=4, init_scores=list(range(H))).eval()
    budget = Budget(s=torch.full((2,), 0.25), k=torch.full((2,), 2))
    assert mlp(torch.randn(2, 3, D), None, budget, None).active.nonzero()[:, 1].tolist() == [6, 7, 6, 7]


def test_stream_sinks_without_a_stream_window_is_refused_not_ignored() -> None:
    # without stream_window nothing streams: stream_sinks=2 changed nothing and said nothing
    with pytest.raises(ValueError, match="topk router: stream_sinks=2 applies only with stream_window"):
        condcomp.CondCompConfig(router=("topk", {"stream_sinks": 2}))
    with pytest.raises(ValueError, match="stream_sinks=2 applies only with stream_window"):
        TopKRouter(num_heads=4, d_model=8, stream_sinks=2)


@pytest.mark.parametrize("sinks", [4, 0])
def test_stream_sinks_equal_to_its_default_without_a_window_is_refused_too(sinks: int) -> None:
    # stream_sinks=4 (the value a window gets by default) without stream_window was accepted and did nothing
    with pytest.raises(ValueError, match=f"topk router: stream_sinks={sinks} applies only with stream_window"):
        condcomp.CondCompConfig(router=("topk", {"stream_sinks": sinks}))
    with pytest.raises(ValueError, match=f"stream_sinks={sinks} applies only with stream_window"):
        TopKRouter(num_heads=4, d_model=8, stream_sinks=sinks)


def test_stream_sinks_default_is_four_with_a_window() -> None:
    with pytest.warns(DeprecationWarning, match="'sinks': 4, 'window': 8"):
        router = TopKRouter(num_heads=4, d_model=8, stream_window=8)
    assert router.stream is not None and (router.stream.sinks, router.stream.window) == (4, 8)


@pytest.mark.parametrize("option", ["stream_window", "stream_sinks"])
@pytest.mark.parametrize("bad", [True, 2.5, "8", -1])
def test_stream_options_refuse_what_is_not_a_token_count(option: str, bad: Any) -> None:
    # int(True) == 1 and int("8") == 8: a cast would quietly keep a different window than the one asked for
    options = {"stream_window": 8, option: bad}
    with pytest.raises(ValueError, match=f"topk router: {option} .* must be a whole number"):
        TopKRouter(num_heads=4, d_model=8, **options)
