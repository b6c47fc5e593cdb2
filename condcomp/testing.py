"""The component contract, as one call on your own router or policy: ``check_router`` and ``check_policy``
(and ``check_kv_policy`` for a KV policy, :mod:`condcomp.testing_kv`).

``tests/test_components.py`` runs these on every registered component of the package; run them in your own
tests on yours (a registered name, or the class the ``register_*`` decorator registered):

>>> import condcomp
>>> from condcomp.testing import check_policy, check_router
>>> check_router("topk")
>>> check_policy("fixed")

A broken component fails with an ``AssertionError`` that names the component, what was wrong and what to do.
What is checked, on a small layer (``d_model`` 32, 8 heads, 3 examples of 5 tokens, one of them padded):

- built as ``apply_`` builds it (default options, or ``options``; layer facts by name), in training mode;
  float32 routing parameters;
- forward: the output type and shapes (a router's ``HeadPlan`` in its granularity, a policy's ``Budget`` with
  ``k`` an int64 in ``[0, H]`` and ``s`` in ``[0, 1]``), finite values, a plan consistent with itself
  (``counts``, ``order``, no gate on an inactive head);
- backward: every parameter receives a finite gradient, unless declared non-trainable (``requires_grad=False``, or
  its name in a class attribute ``non_trainable = ("name", ...)``); auxiliary losses are finite scalars;
- budgets k = 0, 1 and H (routers, evaluation mode): a well-formed plan each time; a sequence router keeps
  exactly ``k`` heads (``plan_top_k`` does);
- padding: what a padded token holds changes neither the plan nor the budget of the real tokens, and a
  per-token router gives padded tokens no heads;
- a bfloat16 input stays finite (routing computes in float32);
- end to end: wrapped in a ``RoutedAttention`` (with the ``random`` router or the ``fixed`` policy as the other
  role) through every executor able to run it, forward and backward without NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.registry import POLICIES, ROUTERS, registered_name
from condcomp.testing_kv import (
    check_kv_policy,  # noqa: F401 - the KV-policy contract, re-exported
    require,
)
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
    require(not missing, (f"{what}: parameters {missing} received no gradient; train them, or declare them "
                           "non-trainable (requires_grad=False or a non_trainable class attribute)"))
    bad = [n for n, p in trainable(component).items() if not torch.isfinite(p.grad).all()]  # type: ignore[arg-type]
    require(not bad, f"{what}: non-finite gradients for {bad}")


def inputs() -> tuple[Tensor, Tensor]:
    """``x (B, T, D)`` requiring grad and a mask with one padded example (tokens 3.. of example 1)."""
    x = torch.randn(B, T, D, requires_grad=True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    return x, mask


def with_other_padding(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with large values in its padded positions (which must not matter)."""
    return x.detach().masked_fill(~mask.unsqueeze(-1), 50.0)


def aux_total(losses: dict[str, Tensor], what: str) -> Tensor:
    for name, value in losses.items():
        require(isinstance(value, Tensor) and value.dim() == 0, f"{what}: aux loss {name!r} must be a scalar tensor")
        require(torch.isfinite(value), f"{what}: aux loss {name!r} is not finite ({float(value)})")
    return sum(losses.values(), torch.zeros(()))


def budget_of(granularity: str, k: int, x: Tensor) -> Budget:
    """A budget of ``k`` heads in a router's granularity: per example ``(B,)`` or per token ``(B, T)``."""
    shape = x.shape[:2] if granularity == "token" else x.shape[:1]
    return Budget(s=torch.full(shape, k / H), k=torch.full(shape, k))


def _float32_parameters(component: Any, what: str) -> None:
    if isinstance(component, nn.Module):
        bad = [n for n, p in component.named_parameters() if p.dtype != torch.float32]
        require(not bad, f"{what}: routing parameters {bad} must be float32 (whatever the model's dtype)")


def _call(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except AssertionError:
        raise
    except Exception as err:  # a crash is a contract failure too; say where it happened
        raise AssertionError(f"{what} raised {type(err).__name__}: {err}") from err


def check_plan(plan: Any, granularity: str, what: str) -> None:
    """A ``HeadPlan`` of shape ``(B, H)`` / ``(B, T, H)``, finite, consistent with itself."""
    require(isinstance(plan, HeadPlan), f"{what}: returned {type(plan).__name__}, not a condcomp.HeadPlan")
    require(plan.granularity == granularity, (f"{what}: a {plan.granularity} plan from a router that declares "
                                               f"granularity = {granularity!r}"))
    want = (B, H) if granularity == "sequence" else (B, T, H)
    require(tuple(plan.gates.shape) == want and tuple(plan.active.shape) == want, (
          f"{what}: gates {tuple(plan.gates.shape)} and active {tuple(plan.active.shape)}, expected {want} "
          f"for a {granularity} router"))
    require(plan.active.dtype == torch.bool, f"{what}: active must be a bool tensor, got {plan.active.dtype}")
    require(torch.equal(plan.counts, plan.active.sum(-1)), f"{what}: counts differ from active.sum(-1)")
    require(torch.isfinite(plan.gates).all(), f"{what}: non-finite gates (NaN or inf): {plan.gates.tolist()}")
    require(torch.equal(plan.gates[~plan.active], torch.zeros_like(plan.gates[~plan.active])), (
          f"{what}: a head that is not active has a non-zero gate"))
    require(torch.equal(torch.gather(plan.active, -1, plan.order),
                         torch.arange(H).expand(want) < plan.counts.unsqueeze(-1)), (
          f"{what}: order must list the active heads first; build plans with condcomp.plan_top_k or plan_from_active"))


def check_router(router: Any, options: dict[str, Any] | None = None) -> None:
    """Run the router contract on a registered router (its name or class); ``options``: its config options."""
    name = registered_name(router, ROUTERS)
    what = f"router {name!r}"
    r = _call(f"{what}: building it", lambda: ROUTERS.build(name, dict(options or {}), FACTS))
    require(r.granularity in ("sequence", "token"), f"{what}: granularity must be 'sequence' or 'token'")
    require(isinstance(r, condcomp.Router), f"{what}: not a condcomp.Router (granularity and a forward call)")
    if isinstance(r, nn.Module):
        r.train()
    _float32_parameters(r, what)
    x, mask = inputs()
    attn = condcomp.HeadAttention(D, H).weights()
    plan = _call(f"{what}: forward", lambda: r(x, mask, budget_of(r.granularity, H // 2, x), attn))
    check_plan(plan, r.granularity, what)
    loss = (plan.gates * torch.randn(plan.gates.shape)).sum() + aux_total(plan.aux_losses, what)
    if loss.requires_grad:
        _call(f"{what}: backward", loss.backward)
    assert_every_parameter_has_a_gradient(r, f"{what} (training mode)")
    if isinstance(r, nn.Module):
        r.eval()
    with torch.no_grad():
        for k in (0, 1, H):
            budget = budget_of(r.granularity, k, x)
            p = _call(f"{what}: forward at k = {k}", partial(r, x, mask, budget, attn))
            check_plan(p, r.granularity, f"{what} at k = {k}")
            if r.granularity == "sequence":
                require(bool((p.counts == k).all()), (f"{what}: ran {p.counts.tolist()} heads where the budget "
                                                       f"allowed k = {k}; a sequence router keeps budget.k heads"))
        _check_padding(r, x, mask, attn, what)
        attn16 = condcomp.HeadAttention(D, H).to(torch.bfloat16).weights()  # a bfloat16 model's weights
        p16 = _call(f"{what}: bfloat16 forward",
                    lambda: r(x.detach().bfloat16(), mask, budget_of(r.granularity, H // 2, x), attn16))
        require(torch.isfinite(p16.gates.float()).all(), f"{what}: non-finite gates on a bfloat16 input")
        require(tuple(p16.gates.shape) == tuple(plan.gates.shape), f"{what}: other shapes on a bfloat16 input")
    executors = [e for e in condcomp.list_executors() if r.granularity in get_executor(e).granularities]
    require(executors, f"{what}: no executor runs {r.granularity} plans")
    for executor in executors:
        end_to_end(wrapped("fixed", name, executor, policy_options={"per_token": r.granularity == "token"},
                           router_options=options), f"{what} with executor {executor!r}")


def _check_padding(r: Any, x: Tensor, mask: Tensor, attn: Any, what: str) -> None:
    budget = budget_of(r.granularity, H // 2, x)
    torch.manual_seed(0)  # a router that draws (random) draws the same twice
    p1 = r(x.detach(), mask, budget, attn)
    torch.manual_seed(0)
    p2 = r(with_other_padding(x, mask), mask, budget, attn)
    real = slice(None) if r.granularity == "sequence" else mask
    require(torch.equal(p1.gates[real], p2.gates[real]) and torch.equal(p1.active[real], p2.active[real]), (
          f"{what}: the plan of real tokens changed with what padded tokens hold; leave them out of the scores "
          "(multiply by the mask, or pass mask= to plan_top_k)"))
    if r.granularity == "token":
        require(not p1.active[~mask].any(), f"{what}: padded tokens got heads; pass mask= to plan_top_k")


def check_policy(policy: Any, options: dict[str, Any] | None = None) -> None:
    """Run the budget-policy contract on a registered policy (its name or class); ``options``: its options."""
    name = registered_name(policy, POLICIES)
    what = f"policy {name!r}"
    p = _call(f"{what}: building it", lambda: POLICIES.build(name, dict(options or {}), FACTS))
    require(isinstance(p, condcomp.BudgetPolicy), f"{what}: not a condcomp.BudgetPolicy (a forward call)")
    p = cast(Any, p)  # a policy may declare more (reads_condition, condition_dim)
    if isinstance(p, nn.Module):
        p.train()
    _float32_parameters(p, what)
    x, mask = inputs()
    # A policy that reads a conditioning vector (budgetformer_cond) gets one, as the layer would pass it.
    cond = {"condition": torch.randn(B, p.condition_dim)} if getattr(p, "reads_condition", False) else {}
    budget = _call(f"{what}: forward", lambda: p(x, mask, **cond))
    check_budget(budget, what)
    loss = budget.s.float().sum() + aux_total(budget.aux_losses, what)
    if loss.requires_grad:
        _call(f"{what}: backward", loss.backward)
    assert_every_parameter_has_a_gradient(p, what)
    if x.grad is not None:
        require(torch.isfinite(x.grad).all(), f"{what}: non-finite gradient reaching the input")
    if isinstance(p, nn.Module):
        p.eval()  # low-precision models: routing computes in float32 and stays finite
    with torch.no_grad():
        b1, b2 = p(x.detach(), mask, **cond), p(with_other_padding(x, mask), mask, **cond)
        real = slice(None) if b1.s.dim() == 1 else mask
        require(torch.equal(b1.s[real], b2.s[real]) and torch.equal(b1.k[real], b2.k[real]), (
              f"{what}: the budget changed with what padded tokens hold; leave them out (a masked mean)"))
        b16 = _call(f"{what}: bfloat16 forward", lambda: p(x.detach().bfloat16(), mask, **cond))
    require(torch.isfinite(b16.s.float()).all() and b16.k.shape == b16.s.shape, (
          f"{what}: a bfloat16 input gave non-finite s or mismatched shapes"))
    end_to_end(wrapped(name, "random", "auto", policy_options=options), f"{what} with the random router")


def check_budget(budget: Any, what: str) -> None:
    """A ``Budget`` with ``s`` in [0, 1] and ``k`` int64 in [0, H], both ``(B,)`` or ``(B, T)``, within the bounds
    it declares (``k_cap``, ``k_floor``)."""
    require(isinstance(budget, Budget), f"{what}: returned {type(budget).__name__}, not a condcomp.Budget")
    require(tuple(budget.s.shape) in ((B,), (B, T)) and budget.k.shape == budget.s.shape, (
          f"{what}: s {tuple(budget.s.shape)} and k {tuple(budget.k.shape)} must both be ({B},) or ({B}, {T})"))
    require(budget.k.dtype == torch.int64 and bool(((budget.k >= 0) & (budget.k <= H)).all()), (
          f"{what}: k must be int64 in [0, {H}], got {budget.k.dtype} {budget.k.tolist()}; use condcomp.budget_k"))
    require(torch.isfinite(budget.s).all() and bool(((budget.s >= 0) & (budget.s <= 1)).all()), (
          f"{what}: s must be finite and in [0, 1], got {budget.s.tolist()}"))
    require(budget.k_cap is None or bool((budget.k <= budget.k_cap).all()), (
          f"{what}: declared k_cap = {budget.k_cap} but k reaches {int(budget.k.max())}; declare a bound k keeps"))
    require(budget.k_floor is None or bool((budget.k >= budget.k_floor).all()), (
          f"{what}: declared k_floor = {budget.k_floor} but k falls to {int(budget.k.min())}; declare a bound k keeps"))


def wrapped(policy: str, router: str, executor: str, policy_options: dict[str, Any] | None = None,
            router_options: dict[str, Any] | None = None) -> condcomp.RoutedAttention:
    """A ``HeadAttention(D, H)`` routed by ``policy`` + ``router`` (``fixed`` at half the heads), in training mode."""
    pol_kw = {"fraction": 0.5, **(policy_options or {})} if policy == "fixed" else dict(policy_options or {})
    cfg = condcomp.CondCompConfig(policy=(policy, pol_kw), router=(router, dict(router_options or {})),
                                  executor=executor)
    return condcomp.RoutedAttention.wrap(condcomp.HeadAttention(D, H), cfg).train()


def end_to_end(routed: condcomp.RoutedAttention, what: str) -> None:
    """Forward and backward through the routed layer: shapes, no NaN, a usage report in range."""
    x, mask = inputs()
    y = _call(f"{what}: forward of the routed layer",
              lambda: routed(x, mask, condition=torch.randn(B, D)))  # read only by policies that read it
    require(y.shape == (B, T, D) and torch.isfinite(y).all(), f"{what}: the routed layer's output is not finite")
    _call(f"{what}: backward of the routed layer", (y.square().mean() + condcomp.aux_loss(routed)).backward)
    require(x.grad is not None and torch.isfinite(x.grad).all(), f"{what}: no finite gradient reaches the input")
    bad = [n for n, p in routed.base.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    require(not bad, f"{what}: non-finite gradients of the attention weights {bad}")
    usage = routed.head_usage()
    if usage is None:
        raise AssertionError(f"{what}: the routed layer reports no head usage")
    require(0.0 <= usage.k_frac <= 1.0 and 0.0 <= usage.s_mean <= 1.0 and usage.flop_frac >= 0.0,
             f"{what}: head usage out of range ({usage})")
