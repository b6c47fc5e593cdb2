"""Property-based tests (hypothesis) over shapes, masks and plans: executors agree with the reference, rows
without keys or heads are exact zeros, and the budget rule holds for any fraction."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from core_helpers import (
    TOLERANCES,
    fused_qkv_weights,
    leaf_plan,
    make_layout,
    make_weights,
    random_active,
    run_and_grads,
    weight_leaves,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.types import AttentionInputs

OTHERS = [e for e in condcomp.list_executors() if e != "reference"]


@st.composite
def attention_problems(draw: st.DrawFn) -> dict:
    H = draw(st.sampled_from([1, 2, 3, 4]))
    Hkv = draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))
    return {
        "B": draw(st.integers(1, 3)),
        "T": draw(st.integers(1, 6)),
        "H": H,
        "Hkv": Hkv,
        "Dh": draw(st.sampled_from([1, 2, 4])),
        "D": draw(st.sampled_from([3, 8])),
        "causal": draw(st.booleans()),
        "token": draw(st.booleans()),
        "mask_bits": draw(st.lists(st.booleans(), min_size=18, max_size=18)),
        "masked": draw(st.booleans()),
        "biases": draw(st.tuples(*[st.booleans()] * 4)),  # which of the q, k, v, o biases exist
        "fused": draw(st.booleans()),  # q/k/v sliced from one in-projection (only when Hkv == H)
        "seed": draw(st.integers(0, 2**16)),
    }


@pytest.mark.parametrize("executor_name", OTHERS)
@settings(max_examples=40, deadline=None)
@given(p=attention_problems())
def test_executor_equals_reference_on_random_problems(executor_name: str, p: dict) -> None:
    torch.manual_seed(p["seed"])
    B, T, H = p["B"], p["T"], p["H"]
    layout = make_layout(H=H, Hkv=p["Hkv"], Dh=p["Dh"], D=p["D"], causal=p["causal"])
    w = make_weights(layout)
    w = replace(w, **{f"{n}_bias": None for n, keep in zip("qkvo", p["biases"]) if not keep})
    wleaves = weight_leaves(w)
    if p["fused"] and p["Hkv"] == H:
        w, wleaves = fused_qkv_weights(w)
    x = torch.randn(B, T, p["D"], dtype=torch.float64, requires_grad=True)
    mask = None
    if p["masked"]:
        mask = torch.tensor(p["mask_bits"][: B * T]).view(B, T)
    active = random_active((B, T, H) if p["token"] else (B, H))
    if p["token"] and mask is not None:
        active = active & mask.unsqueeze(-1)
    plan, gates = leaf_plan(active)
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask)
    ex = get_executor(executor_name)
    if ex.supports(w, inputs, plan) is not None:
        return  # a declared limitation (checked in executors/test_against_reference.py); nothing to compare here
    leaves = {"x": x, "gates": gates, **wleaves}
    probe = torch.randn(B, T, p["D"], dtype=torch.float64)
    y_ref, g_ref = run_and_grads(get_executor("reference"), w, inputs, plan, leaves, probe)
    y, g = run_and_grads(ex, w, inputs, plan, leaves, probe)
    atol, rtol = TOLERANCES[torch.float64]
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    for name in leaves:
        torch.testing.assert_close(g[name], g_ref[name], atol=atol * 10, rtol=rtol * 10, msg=name)
    # rows with no attendable key, and sequence rows with k = 0, are exact zeros (not NaN, not the bias)
    if mask is not None:
        assert torch.equal(y_ref[~mask.any(1)], torch.zeros_like(y_ref[~mask.any(1)]))
    if not p["token"]:
        none = plan.counts == 0
        assert torch.equal(y[none], torch.zeros_like(y[none]))


@settings(max_examples=60, deadline=None)
@given(s=st.floats(0.0, 1.0), H=st.integers(1, 64), k_min=st.integers(0, 4),
       rounding=st.sampled_from(["floor", "ceil", "round"]))
def test_budget_rule_properties(s: float, H: int, k_min: int, rounding: str) -> None:
    k_min = min(k_min, H)
    k = int(condcomp.budget_k(torch.tensor([s]), H, k_min=k_min, rounding=rounding)[0])  # type: ignore[arg-type]
    assert k_min <= k <= H
    exact = s * H
    raw = {"floor": int(exact + 1e-6), "ceil": -int(-(exact - 1e-6) // 1), "round": round(exact)}[rounding]
    # k is the clamped, rounded s * H; s * H within float error of an integer (or of a half, for "round")
    # may land either side, which is what the rule's slack is for
    assert k == max(k_min, min(H, raw)) or abs(2 * exact - round(2 * exact)) < 1e-4


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 5), H=st.integers(1, 8), token=st.booleans(), seed=st.integers(0, 999))
def test_plan_from_active_invariants(B: int, T: int, H: int, token: bool, seed: int) -> None:
    torch.manual_seed(seed)
    shape = (B, T, H) if token else (B, H)
    active = random_active(shape)
    plan = condcomp.plan_from_active(active, torch.rand(shape))
    assert plan.granularity == ("token" if token else "sequence")
    assert torch.equal(plan.counts, active.sum(-1))
    assert torch.equal(plan.gates[~active], torch.zeros_like(plan.gates[~active]))
    picked = torch.gather(active, -1, plan.order)
    # order lists the active heads first, each group ascending, and is a permutation of the heads
    pos = torch.arange(H).expand_as(picked)
    assert torch.equal(picked, pos < plan.counts.unsqueeze(-1))
    assert torch.equal(plan.order.sort(-1).values, torch.arange(H).expand_as(plan.order))
    for row_order, row_active in zip(plan.order.reshape(-1, H), active.reshape(-1, H)):
        n = int(row_active.sum())
        assert row_order[:n].tolist() == sorted(row_order[:n].tolist())
        assert row_order[n:].tolist() == sorted(row_order[n:].tolist())


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 5), H=st.integers(1, 8), seed=st.integers(0, 999))
def test_top_k_keeps_the_k_best(B: int, T: int, H: int, seed: int) -> None:
    torch.manual_seed(seed)
    scores = torch.randn(B, T, H)
    k = torch.randint(0, H + 1, (B, T))
    keep = condcomp.top_k_mask(scores, k)
    assert torch.equal(keep.sum(-1), k)
    lowest_kept = scores.masked_fill(~keep, float("inf")).min(-1).values
    highest_dropped = scores.masked_fill(keep, float("-inf")).max(-1).values
    assert bool((lowest_kept >= highest_dropped).all())


def test_top_k_ties_keep_the_lower_index() -> None:
    """Equal scores are kept lowest head index first (the documented tie rule), per row and with variable k."""
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 2.0], [3.0, 1.0, 3.0, 1.0]])
    keep = condcomp.top_k_mask(scores, torch.tensor([2, 2, 3]))
    assert keep.tolist() == [[True, True, False, False], [False, True, True, False], [True, True, True, False]]


def test_mask_and_plan_dtype_combinations_are_finite() -> None:
    """A zero-head plan on an all-padding batch (the degenerate corner) gives finite zeros in every executor."""
    layout = make_layout(H=2, Dh=2, D=4)
    w = make_weights(layout)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    plan, _ = leaf_plan(torch.zeros(2, 2, dtype=torch.bool))
    for name in condcomp.list_executors():
        y = get_executor(name)(w, replace(AttentionInputs(x=x), mask=mask, key_mask=mask), plan)
        assert torch.equal(y, torch.zeros_like(y)), name
