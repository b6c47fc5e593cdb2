"""Casting a wrapped model (``.to(dtype)``, ``.half()``, ``.double()``) after ``apply_``.

The rule (condcomp/host.py): the attention weights take the new dtype, the policy's and router's parameters stay
float32. The reference is the *unwrapped* module cast the same way: at the full budget the wrapped model must give
its output; at partial budgets every policy x router runs forward and backward in eval and training.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import condcomp

CASTS = {
    "bf16": lambda m: m.to(torch.bfloat16),
    "fp16": lambda m: m.half(),
    "fp64": lambda m: m.double(),
}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
TOL = {"bf16": dict(atol=2e-2, rtol=2e-2), "fp16": dict(atol=2e-3, rtol=2e-3), "fp64": dict(atol=1e-12, rtol=1e-12)}
# Routing options that make every component compute something in training (soft gates, noise, a learned budget).
OPTIONS = {"fixed": {"fraction": 0.5}, "moh": {"shared_heads": 1, "top_k": 2}, "norm": {"shared_heads": 1}}


def _spec(key: str) -> tuple[str, dict[str, object]]:
    return key, dict(OPTIONS.get(key, {}))


def _routing_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for n, p in model.named_parameters() if "condcomp_policy" in n or "condcomp_router" in n}


def _modules() -> dict[str, nn.Module]:
    return {
        "head_attention": nn.Sequential(condcomp.HeadAttention(32, 4)),
        "torch_mha": nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True),
    }


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("kind", ["head_attention", "torch_mha"])
def test_full_budget_after_cast_equals_the_cast_unwrapped_module(kind: str, cast: str) -> None:
    ref = _modules()[kind].eval()
    model = _modules()[kind].eval()
    model.load_state_dict(ref.state_dict())
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="topk", executor="gathered"))
    CASTS[cast](ref)
    CASTS[cast](model)
    assert _routing_dtypes(model) == {torch.float32}
    x = torch.randn(3, 7, 32, dtype=DTYPE[cast])
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), **TOL[cast])


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("policy,router", list(itertools.product(condcomp.list_policies(), condcomp.list_routers())))
def test_every_policy_and_router_trains_and_evaluates_after_a_cast(policy: str, router: str, cast: str) -> None:
    model = nn.Sequential(condcomp.HeadAttention(32, 4))
    cfg = condcomp.CondCompConfig(policy=_spec(policy), router=_spec(router), executor="gathered")
    condcomp.apply_(model, cfg)
    CASTS[cast](model)
    assert _routing_dtypes(model) <= {torch.float32}  # parameter-free components (fixed, norm) have none
    x = torch.randn(2, 6, 32, dtype=DTYPE[cast])
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    model.train()
    cond = torch.randn(2, 32)  # the conditioning vector, read only by policies that declare reads_condition
    y = model[0](x, mask, condition=cond)
    assert y.dtype == DTYPE[cast] and torch.isfinite(y).all()
    (y.float().pow(2).mean() + condcomp.aux_loss(model)).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), name
    model.eval()
    with torch.no_grad():
        y = model[0](x, mask, condition=cond)
    assert y.dtype == DTYPE[cast] and torch.isfinite(y).all()


def test_routing_decisions_of_a_double_model_equal_the_float_model() -> None:
    """Routing stays float32, so casting to float64 must not move one budget or one top-k choice."""
    model = nn.Sequential(condcomp.HeadAttention(32, 8))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="budgetformer", router="topk", executor="reference"))
    model.eval()
    x = torch.randn(4, 9, 32)
    with torch.no_grad():
        model(x)
        plan32 = model[0].last.plan
        model.double()
        model(x.double())
        plan64 = model[0].last.plan
    assert torch.equal(plan32.active, plan64.active)


def test_cast_to_cpu_and_back_keeps_routing_float32() -> None:
    model = nn.Sequential(condcomp.HeadAttention(16, 2))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="budgetformer", router="moh"))
    model.to("cpu", torch.bfloat16).float().half()
    assert _routing_dtypes(model) == {torch.float32}
    assert model[0].q_proj.weight.dtype == torch.float16
