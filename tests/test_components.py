"""Tests generated from the registries: every policy, router and executor, including ones added after this file.

Each component is built the way ``apply_`` builds it (``Registry.build(name, {}, layer facts)``, default
options) and gets shape, forward, backward, no-NaN and "every parameter receives a gradient" checks.

Declaring a parameter non-trainable (docs/extending.md): set ``requires_grad=False`` on it, or list its name
(as ``named_parameters`` spells it) in a class attribute ``non_trainable = ("name", ...)``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from core_helpers import make_layout, make_weights
from torch import Tensor, nn

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.plans import budget_k
from condcomp.registry import EXECUTORS, POLICIES, ROUTERS
from condcomp.types import Budget, HeadPlan

B, T, D, H = 3, 5, 32, 8
FACTS = {"d_model": D, "num_heads": H, "num_kv_heads": H, "head_dim": D // H}


def trainable(component: Any) -> dict[str, nn.Parameter]:
    """Parameters that must receive a gradient: all, minus requires_grad=False and ``non_trainable`` names."""
    if not isinstance(component, nn.Module):
        return {}
    exempt = set(getattr(component, "non_trainable", ()))
    return {n: p for n, p in component.named_parameters() if p.requires_grad and n not in exempt}


def assert_every_parameter_has_a_gradient(component: Any, what: str) -> None:
    missing = [n for n, p in trainable(component).items() if p.grad is None]
    assert not missing, (f"{what}: parameters {missing} received no gradient; train them, or declare them "
                         "non-trainable (requires_grad=False or a non_trainable class attribute)")
    bad = [n for n, p in trainable(component).items() if not torch.isfinite(p.grad).all()]  # type: ignore[arg-type]
    assert not bad, f"{what}: non-finite gradients for {bad}"


def inputs() -> tuple[Tensor, Tensor]:
    x = torch.randn(B, T, D, requires_grad=True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False  # one padded example
    return x, mask


def aux_total(losses: dict[str, Tensor]) -> Tensor:
    for name, value in losses.items():
        assert isinstance(value, Tensor) and value.dim() == 0, f"aux loss {name!r} must be a scalar tensor"
        assert torch.isfinite(value), f"aux loss {name!r} is not finite"
    return sum(losses.values(), torch.zeros(()))


def budget_for(router: Any, x: Tensor) -> Budget:
    """A half budget in the router's granularity: per example ``(B,)`` or per token ``(B, T)``."""
    shape = x.shape[:2] if router.granularity == "token" else x.shape[:1]
    s = torch.full(shape, 0.5)
    return Budget(s=s, k=budget_k(s, H))


@pytest.mark.parametrize("name", condcomp.list_policies())
def test_policy(name: str) -> None:
    policy = POLICIES.build(name, {}, FACTS)
    assert isinstance(policy, condcomp.BudgetPolicy)
    if isinstance(policy, nn.Module):
        policy.train()
        assert all(p.dtype == torch.float32 for p in policy.parameters()), "routing parameters must be float32"
    x, mask = inputs()
    # A policy that reads a conditioning vector (budgetformer_cond) gets one, as the layer would pass it.
    cond = {"condition": torch.randn(B, policy.condition_dim)} if getattr(policy, "reads_condition", False) else {}
    budget = policy(x, mask, **cond)
    assert isinstance(budget, Budget)
    assert budget.s.shape in ((B,), (B, T)) and budget.k.shape == budget.s.shape
    assert budget.k.dtype == torch.int64 and bool(((budget.k >= 0) & (budget.k <= H)).all())
    assert torch.isfinite(budget.s).all() and bool(((budget.s >= 0) & (budget.s <= 1)).all())
    loss = budget.s.float().sum() + aux_total(budget.aux_losses)
    if loss.requires_grad:
        loss.backward()
    assert_every_parameter_has_a_gradient(policy, f"policy {name!r}")
    if x.grad is not None:
        assert torch.isfinite(x.grad).all()
    # low-precision models: routing computes in float32 and stays finite
    if isinstance(policy, nn.Module):
        policy.eval()
    with torch.no_grad():
        b16 = policy(x.detach().bfloat16(), mask, **cond)
    assert torch.isfinite(b16.s.float()).all() and b16.k.shape == b16.s.shape


@pytest.mark.parametrize("name", condcomp.list_routers())
def test_router(name: str) -> None:
    router = ROUTERS.build(name, {}, FACTS)
    assert router.granularity in ("sequence", "token")
    assert isinstance(router, condcomp.Router)
    if isinstance(router, nn.Module):
        router.train()
        assert all(p.dtype == torch.float32 for p in router.parameters()), "routing parameters must be float32"
    x, mask = inputs()
    attn = make_weights(make_layout(H=H, Dh=D // H, D=D), torch.float32)
    plan = router(x, mask, budget_for(router, x), attn)
    assert isinstance(plan, HeadPlan) and plan.granularity == router.granularity
    want = (B, H) if plan.granularity == "sequence" else (B, T, H)
    assert plan.gates.shape == want and plan.active.shape == want and plan.active.dtype == torch.bool
    assert torch.equal(plan.counts, plan.active.sum(-1))
    assert torch.isfinite(plan.gates).all()
    assert torch.equal(plan.gates[~plan.active], torch.zeros_like(plan.gates[~plan.active]))
    assert torch.equal(torch.gather(plan.active, -1, plan.order),
                       torch.arange(H).expand(want) < plan.counts.unsqueeze(-1))
    probe = torch.randn(want)
    loss = (plan.gates * probe).sum() + aux_total(plan.aux_losses)
    if loss.requires_grad:
        loss.backward()
    assert_every_parameter_has_a_gradient(router, f"router {name!r} (training mode)")
    if isinstance(router, nn.Module):
        router.eval()
    attn16 = make_weights(make_layout(H=H, Dh=D // H, D=D), torch.bfloat16)  # a bfloat16 model's weights
    with torch.no_grad():
        p16 = router(x.detach().bfloat16(), mask, budget_for(router, x), attn16)
    assert torch.isfinite(p16.gates.float()).all() and p16.gates.shape == want


@pytest.mark.parametrize("name", condcomp.list_executors())
def test_executor_declares_itself(name: str) -> None:
    ex = get_executor(name)
    assert isinstance(ex, condcomp.Executor)
    assert ex.name == name and EXECUTORS.get(name) is type(ex)
    assert set(ex.granularities) <= {"sequence", "token"} and ex.granularities


def _wrapped(policy: str, router: str, executor: str) -> condcomp.RoutedAttention:
    granularity = ROUTERS.get(router).granularity
    if policy == "fixed":
        spec: Any = ("fixed", {"fraction": 0.5, "per_token": granularity == "token"})
    else:
        spec = policy
    cfg = condcomp.CondCompConfig(policy=spec, router=router, executor=executor)
    routed = condcomp.RoutedAttention.wrap(condcomp.HeadAttention(D, H), cfg)
    return routed.train()


def _end_to_end(routed: condcomp.RoutedAttention) -> None:
    x, mask = inputs()
    y = routed(x, mask, condition=torch.randn(B, D))  # read only by policies that declare reads_condition
    assert y.shape == (B, T, D) and torch.isfinite(y).all()
    (y.square().mean() + condcomp.aux_loss(routed)).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for n, p in routed.base.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), n
    usage = routed.head_usage()
    assert usage is not None
    assert 0.0 <= usage.k_frac <= 1.0 and 0.0 <= usage.s_mean <= 1.0 and usage.flop_frac >= 0.0


def _executors_for(router: str) -> list[str]:
    """Executors that declare the router's granularity (a declared limitation is not a failure)."""
    granularity = ROUTERS.get(router).granularity
    return [e for e in condcomp.list_executors() if granularity in get_executor(e).granularities]


@pytest.mark.parametrize("router", condcomp.list_routers())
def test_router_end_to_end_with_every_executor(router: str) -> None:
    """fixed(0.5) + this router through every executor able to run its plans: forward, backward, no NaN."""
    names = _executors_for(router)
    assert names, f"no executor runs {ROUTERS.get(router).granularity} plans"
    for executor in names:
        _end_to_end(_wrapped("fixed", router, executor))


@pytest.mark.parametrize("policy", condcomp.list_policies())
def test_policy_end_to_end(policy: str) -> None:
    """This policy + the random router (which follows any budget granularity), auto executor."""
    _end_to_end(_wrapped(policy, "random", "auto"))


@pytest.mark.parametrize("kind", ["policy", "router", "executor"])
def test_config_json_round_trip_for_every_component(kind: str) -> None:
    names = {"policy": condcomp.list_policies, "router": condcomp.list_routers,
             "executor": condcomp.list_executors}[kind]()
    for name in names:
        cfg = condcomp.CondCompConfig(**{"policy": "full", "router": "random", "executor": "auto", kind: name})
        again = condcomp.CondCompConfig.from_json(cfg.to_json())
        assert again == cfg, name
        assert condcomp.CondCompConfig.from_dict(cfg.to_dict()) == cfg, name


def test_config_from_a_0_1_file_with_the_empty_extra_field() -> None:
    """0.1 wrote an always-empty ``extra`` field (nothing read it; it is gone): such configs still load."""
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random")
    assert condcomp.CondCompConfig.from_dict({**cfg.to_dict(), "extra": {}}) == cfg
    with pytest.raises(ValueError, match="extra"):
        condcomp.CondCompConfig.from_dict({**cfg.to_dict(), "extra": {"x": 1}})
