"""Mixed precision: autocast bf16/fp16 on CPU through every executor, with routing decisions in float32.

Tolerances (stated in docs/reliability.md): logits of a 2-layer model, values O(1), compared with the float32
run of the same model: bf16 autocast within 5e-2 absolute + 5e-2 relative (bf16 has an 8-bit mantissa, ~4e-3
per rounding, a few dozen roundings deep), fp16 within 5e-3 + 5e-3 (11-bit mantissa).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_models import TinyNet, set_executor
from torch import nn

import condcomp
from condcomp.routed import RoutedAttention

EXECUTORS = condcomp.list_executors()
TOL = {torch.bfloat16: (5e-2, 5e-2), torch.float16: (5e-3, 5e-3)}


def _fp16_autocast_on_cpu() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float16
    except (RuntimeError, ValueError):
        return False


DTYPES = [torch.bfloat16] + ([torch.float16] if _fp16_autocast_on_cpu() else [])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 7, 32, generator=g)
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[2, 4:] = False
    mask[5, 1:] = False
    return x, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_autocast_matches_float32_and_routes_in_float32(executor: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = TinyNet(executor=executor).eval()
    x, mask = _data()
    want = model(x, mask)
    first = model.layers[0].last
    with torch.autocast("cpu", dtype=dtype):
        got = model(x, mask)
    assert got.dtype == dtype
    last = model.layers[0].last
    # the first layer sees the same float32 input, so its decisions must be bit-identical to the float32 run
    assert last.s.dtype == torch.float32 and last.plan.gates.dtype == torch.float32
    assert torch.equal(last.s, first.s)
    assert torch.equal(last.plan.active, first.plan.active)
    assert torch.equal(last.plan.gates, first.plan.gates)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_autocast_backward_is_finite_and_close(executor: str) -> None:
    torch.manual_seed(0)
    model = TinyNet(executor=executor).train()
    x, mask = _data()
    y = torch.tensor([0, 1, 2, 0, 1, 2])

    def grads(autocast: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x, mask).float(), y) + condcomp.aux_loss(model)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    g32, g16 = grads(False), grads(True)
    assert g32.keys() == g16.keys()
    for name in g32:
        assert torch.isfinite(g16[name]).all(), name
        scale = g32[name].abs().max().clamp_min(1e-3)
        assert (g16[name] - g32[name]).abs().max() <= 0.1 * scale, name  # relative to the tensor's largest entry


def _combos() -> list[tuple[str, str]]:
    return list(itertools.product(condcomp.list_policies(), condcomp.list_routers()))


def _routed_model(policy: str, router: str, executor: str) -> nn.Module | None:
    model = nn.Sequential(condcomp.HeadAttention(32, 4), condcomp.HeadAttention(32, 4))
    try:
        condcomp.apply_(model, condcomp.CondCompConfig(policy=policy, router=router, executor=executor))
        model(torch.randn(2, 3, 32))
    except (ValueError, TypeError):
        return None  # an incompatible pairing (e.g. per-token budget with a per-example router) says so itself
    return model


@pytest.mark.parametrize("policy,router", _combos())
def test_every_registered_policy_and_router_decides_in_float32(policy: str, router: str) -> None:
    """Under bf16 autocast and with a bf16 model, budgets and gates are float32 (the components cast)."""
    torch.manual_seed(0)
    model = _routed_model(policy, router, "masked")
    if model is None:
        assert policy != "full" or router != "random", "the basic pairing must work"
        return
    x = torch.randn(3, 5, 32)
    for train in (True, False):
        model.train(train)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert torch.isfinite(out.float()).all()
        for m in model.modules():
            if isinstance(m, RoutedAttention):
                assert m.last is not None
                assert m.last.s.dtype == torch.float32, f"{policy}: budget computed in {m.last.s.dtype}"
                assert m.last.plan.gates.dtype == torch.float32, f"{router}: gates in {m.last.plan.gates.dtype}"
    # A model converted to bf16 keeps its routing components in float32 only if the user leaves them there:
    # the attention weights go bf16, the components must cast x to float32 themselves.
    for m in model.modules():
        if isinstance(m, RoutedAttention):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(m, name).to(torch.bfloat16)
    out = model(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    for m in model.modules():
        if isinstance(m, RoutedAttention):
            assert m.last is not None and m.last.s.dtype == torch.float32, f"{policy} with a bf16 input"
            assert m.last.plan.gates.dtype == torch.float32, f"{router} with a bf16 input"


def test_set_executor_helper_switches_every_layer() -> None:
    model = TinyNet()
    set_executor(model, "masked")
    assert {m.executor for m in model.modules() if isinstance(m, RoutedAttention)} == {"masked"}
