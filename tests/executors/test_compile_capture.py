"""``torch.compile(fullgraph=True)`` captures a wrapped model with the gathered executor at sequence and token plans.

A graph break is a host read or a data-dependent shape: the check of the GPU discipline that needs no GPU. Models:
condcomp's own HeadAttention stack (``condcomp bench compile``'s) and ``nn.TransformerEncoder``; policies ``fixed``,
``budgetformer`` and ``budgetformer`` with ``cap_at_s_max``; the ``topk`` router; eval and train. Each compiled model
(the eager backend: no code generation) is compared with the same weights run eagerly by the per-head ``reference``
executor, outputs and parameter gradients. Token plans: the ``moh`` router (shared heads + top-k routed heads, its
load-balance loss in the gradients) at the ``full`` and ``fixed`` budgets, run by ``token.static``.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import condcomp
from condcomp.bench.compile import Stack

POLICIES: dict[str, Any] = {
    "fixed": ("fixed", {"fraction": 0.5}),
    "budgetformer": ("budgetformer", {}),
    "budgetformer_capped": ("budgetformer", {"s_max": 0.5, "cap_at_s_max": True}),
}
ROUTER = ("topk", {"noise_std": 0.0})  # training without noise: the compiled and eager runs draw the same plan
MOH = ("moh", {"shared_heads": 1, "top_k": 2})
MOH_POLICIES: dict[str, Any] = {"full": "full", "fixed": ("fixed", {"fraction": 0.5, "per_token": True})}


def build(kind: str, policy: str, executor: str, train: bool, router: Any = ROUTER) -> nn.Module:
    torch.manual_seed(0)
    if kind == "stack":
        model: nn.Module = Stack(32, 4, 2)
    else:
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    policies = MOH_POLICIES if router is MOH else POLICIES
    condcomp.apply_(model, condcomp.CondCompConfig(policy=policies[policy], router=router, executor=executor))
    return model.train(train)


def with_executor(model: nn.Module, executor: str) -> nn.Module:
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, condcomp.RoutedAttention):
            m.executor = executor
    return twin


def inputs(kind: str) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 32, generator=gen)
    if kind == "encoder":
        return (x,)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False  # padding
    return x, mask


def grads(model: nn.Module, out: Tensor) -> dict[str, Tensor]:
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + condcomp.aux_loss(model)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # 5-10 s a case (dynamo tracing); the fast suite captures one model below
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", ["stack", "encoder"])
def test_fullgraph_capture_equals_the_reference(kind: str, policy: str, train: bool) -> None:
    model = build(kind, policy, "gathered", train)
    reference = with_executor(model, "reference")
    args = inputs(kind)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(*args).graph_break_count == 0
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    y = compiled(*args)
    want = reference(*args)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    usage = condcomp.head_usage(model)
    assert usage and all(u.strategy == "sequence.static" for u in usage.values())
    if not train:
        return
    got_g, want_g = grads(model, y), grads(reference, want)
    assert got_g.keys() == want_g.keys() and got_g
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def check_capture(model: nn.Module, kind: str, train: bool, strategy: str) -> None:
    """0 graph breaks; the compiled model equals the reference executor's, outputs and parameter gradients."""
    reference = with_executor(model, "reference")
    args = inputs(kind)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(*args).graph_break_count == 0
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    y = torch.compile(model, backend="eager", fullgraph=True)(*args)
    want = reference(*args)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    usage = condcomp.head_usage(model)
    assert usage and all(u.strategy == strategy for u in usage.values())
    if not train:
        return
    got_g, want_g = grads(model, y), grads(reference, want)
    assert got_g.keys() == want_g.keys() and any("router" in n for n in got_g)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # 5-10 s a case; the fast suite captures one below
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("policy", list(MOH_POLICIES))
@pytest.mark.parametrize("kind", ["stack", "encoder"])
def test_moh_fullgraph_capture_equals_the_reference(kind: str, policy: str, train: bool) -> None:
    check_capture(build(kind, policy, "gathered", train, MOH), kind, train, "token.static")


def test_a_moh_stack_is_captured_in_training() -> None:
    """MoH's token plans (router, load balance, token.static) in one graph, gradients equal to the reference's."""
    check_capture(build("stack", "full", "gathered", True, MOH), "stack", True, "token.static")


def test_a_capped_plan_computes_the_cap_under_compile() -> None:
    """fixed 0.5 of 4 heads: k_cap 2, so the compiled path keeps 2 heads per example, not 4 (and fullgraph=True
    captures it: a graph break would raise)."""
    model = build("stack", "fixed", "gathered", False)
    reference = with_executor(model, "reference")
    torch._dynamo.reset()
    y = torch.compile(model, backend="eager", fullgraph=True)(*inputs("stack"))
    torch.testing.assert_close(y, reference(*inputs("stack")), atol=1e-5, rtol=1e-5)
    plans = [m.last.plan for m in model.modules() if isinstance(m, condcomp.RoutedAttention)]
    assert [p.k_cap for p in plans] == [2, 2] and all(p.counts.tolist() == [2, 2, 2] for p in plans)
    assert {u.strategy for u in condcomp.head_usage(model).values()} == {"sequence.static"}


@pytest.mark.slow  # about 7 s: three compiles
def test_a_changed_fixed_fraction_recompiles_with_its_own_cap() -> None:
    """A budget sweep on one compiled model: ``policy.fraction`` set to 0.25, then 1.0 after a first call at 0.5.
    The recompiled graph failed under ``fullgraph=True`` (the changed float traced as a symbol that the cap's host
    rounding cannot take); it now recompiles with each fraction's cap and equals the reference executor, and a
    fraction out of range is refused when set."""
    model = build("stack", "fixed", "gathered", False)
    reference = with_executor(model, "reference")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for fraction, k in ((0.5, 2), (0.25, 1), (1.0, 4)):
        for m in (model, reference):
            for policy in m.modules():
                if hasattr(policy, "fraction"):
                    policy.fraction = fraction
        y = compiled(*inputs("stack"))
        torch.testing.assert_close(y, reference(*inputs("stack")), atol=1e-5, rtol=1e-5)
        plans = [m.last.plan for m in model.modules() if isinstance(m, condcomp.RoutedAttention)]
        assert [p.k_cap for p in plans] == [k, k] and all(p.counts.tolist() == [k] * 3 for p in plans)
    policy = next(p for p in model.modules() if hasattr(p, "fraction"))
    with pytest.raises(ValueError, match="fraction"):
        policy.fraction = 1.5
    assert policy.fraction == 1.0


def test_a_fixed_policy_pickled_before_its_cap_was_kept_loads_with_it() -> None:
    """A wrapped model saved whole (``torch.save(model)``) before the fixed policy kept its cap as an attribute loads
    and runs: the cap is recomputed from its options (k = floor(0.25 * 8) = 2 by hand), and the outputs equal those
    of the model it was saved from."""
    from condcomp.policies.fixed import FixedPolicy

    policy = FixedPolicy(8, fraction=0.25)
    old = {k: v for k, v in policy.__dict__.items() if k != "_cap"}  # what such a pickle holds
    loaded = FixedPolicy.__new__(FixedPolicy)
    loaded.__setstate__(old)
    x = torch.randn(2, 5, 16)
    assert loaded(x, None).k_cap == 2 and loaded(x, None).k.tolist() == [2, 2]
    model = build("stack", "fixed", "gathered", False)
    again = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(again(*inputs("stack")), model(*inputs("stack")))


@pytest.mark.parametrize("policy", ["fixed", "budgetformer"])
def test_auto_is_captured_too(policy: str) -> None:
    model = build("stack", policy, "auto", False)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(*inputs("stack")).graph_break_count == 0


def test_auto_runs_moh_masked_under_compile() -> None:
    """auto at MoH's token plans under compile: the capturable token path costs dense attention, so auto runs
    masked, captured whole too."""
    model = build("stack", "full", "auto", False, MOH)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(*inputs("stack")).graph_break_count == 0
    assert {u.executor for u in condcomp.head_usage(model).values()} == {"masked"}


@pytest.mark.slow
def test_inductor_compiles_the_static_path() -> None:
    """The default backend (inductor: generated C++ on CPU), forward and backward, against the reference."""
    model = build("stack", "fixed", "gathered", True)
    reference = with_executor(model, "reference")
    args = inputs("stack")
    torch._dynamo.reset()
    y = torch.compile(model, fullgraph=True)(*args)
    want = reference(*args)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    got_g, want_g = grads(model, y), grads(reference, want)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=1e-3, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
