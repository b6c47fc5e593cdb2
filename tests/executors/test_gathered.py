"""The gathered executor against the per-head reference on the situations its packing has to get right.

The registry-driven suite (test_against_reference.py) already compares it on the common cases; these add the
strategies specific to packing: the sequence plans' grouped GEMMs and buckets (each forced by name), several (k, k_kv)
buckets at once, one bucket covering the batch, every example at k = 0, cross-attention, token plans whose shared
heads run densely next to gathered routed heads, token plans with causal masks, rotary, GQA, per-head additive
biases and a KV cache, and half-precision dtypes.

Tolerances (atol, rtol) per dtype: float64 (1e-10, 1e-9): only the summation order differs; float32 (2e-5, 1e-4);
bfloat16 and float16 (3e-2, 3e-2) on outputs, ten times looser on gradients (conftest.TOLERANCES plus float16).
"""

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
    moh_active,
    rotary_tables,
    run_and_grads,
    seq_active,
    weight_leaves,
)
from torch import Tensor

from condcomp.executors import grouped_gemm
from condcomp.executors.auto import get_executor
from condcomp.executors.base import qkv_head_rows
from condcomp.executors.gathered import CPU, GatheredCall, GatheredExecutor, GatherSizes, gather_sizes, get_strategy
from condcomp.executors.gathered.sizing import routed_head_sets
from condcomp.executors.gathered.token import _compact
from condcomp.plans import top_k_mask
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

TOL = {**TOLERANCES, torch.float16: (3e-2, 3e-2)}
TOY = replace(CPU, min_set_work=0)  # the per-set token strategy's size rule lifted for the tests' toy shapes


def check(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, leaves: dict[str, Tensor],
          gathered: GatheredExecutor | None = None) -> Tensor:
    """Assert gathered == reference on outputs and on the gradients of every leaf; returns gathered's output."""
    dtype = inputs.x.dtype
    atol, rtol = TOL[dtype]
    probe = torch.randn(inputs.x.shape[0], inputs.x.shape[1], w.layout.d_model, dtype=torch.float64).to(dtype)
    gathered = gathered or get_executor("gathered")
    assert gathered.supports(w, inputs, plan) is None
    y_ref, g_ref = run_and_grads(get_executor("reference"), w, inputs, plan, leaves, probe)
    y, g = run_and_grads(gathered, w, inputs, plan, leaves, probe)
    assert y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=rtol)
    for name in leaves:
        torch.testing.assert_close(g[name].float(), g_ref[name].float(), atol=atol * 10, rtol=rtol * 10,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")
    return y


def setup(B: int = 6, T: int = 7, H: int = 8, Hkv: int | None = None, Dh: int = 4, D: int = 24,
          causal: bool = False, dtype: torch.dtype = torch.float64) -> tuple[AttentionWeights, Tensor, dict]:
    w = make_weights(make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=causal), dtype)
    x = torch.randn(B, T, D, dtype=torch.float64).to(dtype).requires_grad_()
    return w, x, {"x": x, **weight_leaves(w)}


def sequence_strategy(path: str) -> GatheredExecutor:
    """The gathered executor forced onto one strategy for variable-k sequence plans: ``grouped`` (grouped GEMMs, the
    default on CPU with MKL) or ``buckets`` (batched matmuls per bucket, the default elsewhere)."""
    if path == "grouped" and not grouped_gemm.available(torch.zeros(1)):
        pytest.skip("this torch build exports no MKL cblas_?gemm_batch (only x86 builds with MKL do)")
    return GatheredExecutor(strategy=f"sequence.{path}")


@pytest.mark.parametrize(("Hkv", "path", "causal"), [(8, "grouped", False), (8, "grouped", True), (4, "grouped", True),
                                                     (2, "grouped", False), (8, "buckets", False), (8, "buckets", True),
                                                     (4, "buckets", True), (2, "buckets", False)])
def test_sequence_many_buckets(Hkv: int, path: str, causal: bool) -> None:
    """Variable k (0, 1, 3, 3, 5, H) and, with GQA, variable key/value head counts: several buckets in one call.

    Grouped GEMMs over the pairs (with GQA: keys and values once per example and key/value head), or one block
    per bucket.
    """
    gathered = sequence_strategy(path)
    w, x, leaves = setup(Hkv=Hkv, causal=causal)
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[1, 5:] = False
    mask[4, :2] = False
    plan, gates = leaf_plan(seq_active([0, 1, 3, 3, 5, 8], 8))
    sizes = gather_sizes(w, AttentionInputs(x=x), plan)
    assert sum(n for _, _, n in sizes.buckets) == 6 and len(sizes.buckets) >= 5
    y = check(w, AttentionInputs(x=x, mask=mask, key_mask=mask), plan, {**leaves, "gates": gates}, gathered)
    assert torch.equal(y[0], torch.zeros_like(y[0]))  # k = 0: exactly zero, no output bias


@pytest.mark.parametrize("path", ["grouped", "buckets"])
@pytest.mark.parametrize("drop_key_bias", [False, True])
def test_sequence_fused_in_projection_and_missing_key_bias(path: str, drop_key_bias: bool) -> None:
    """q/k/v sliced from one in-projection are gathered from it directly (gradients reach the fused leaf), and a
    missing key bias counts as zeros while the query and value biases still apply (they were once dropped)."""
    gathered = sequence_strategy(path)
    w, x, _ = setup()
    w, leaves = fused_qkv_weights(replace(w, k_bias=None) if drop_key_bias else w)
    plan, gates = leaf_plan(seq_active([0, 1, 3, 3, 5, 8], 8))
    check(w, AttentionInputs(x=x), plan, {"x": x, **leaves, "gates": gates}, gathered)


def test_qkv_head_rows_is_a_view_of_a_fused_in_projection() -> None:
    """No copy when q/k/v are consecutive slices of one tensor; separate tensors (or another order) are copied."""
    w, _, _ = setup()
    fused, _ = fused_qkv_weights(w)
    rows, bias = qkv_head_rows(fused)
    assert rows.data_ptr() == fused.q_weight.data_ptr() and bias is not None
    assert bias.data_ptr() == fused.q_bias.data_ptr()  # type: ignore[union-attr]
    H, Dh, D = 8, 4, 24
    want = torch.cat([w.q_weight, w.k_weight, w.v_weight]).view(3 * H, Dh * D)
    torch.testing.assert_close(rows, want, atol=0, rtol=0)
    swapped = replace(fused, q_weight=fused.k_weight, k_weight=fused.q_weight)  # same base, wrong order
    rows, _ = qkv_head_rows(swapped)
    assert rows.data_ptr() != fused.q_weight.data_ptr()
    torch.testing.assert_close(rows, torch.cat([w.k_weight, w.q_weight, w.v_weight]).view(3 * H, Dh * D),
                               atol=0, rtol=0)
    rows, bias = qkv_head_rows(replace(w, k_bias=None))  # separate leaves: copied; missing key bias: zeros
    assert bias is not None and torch.equal(bias[H:2 * H], torch.zeros(H, Dh, dtype=bias.dtype))
    torch.testing.assert_close(bias[:H], w.q_bias.view(H, Dh), atol=0, rtol=0)  # type: ignore[union-attr]


@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_sequence_one_bucket(k: int) -> None:
    """Every example with the same k: the whole batch runs as one block without gathering examples."""
    w, x, leaves = setup()
    plan, gates = leaf_plan(seq_active([k] * 6, 8))
    assert len(gather_sizes(w, AttentionInputs(x=x), plan).buckets) == 1
    strategies = {0: "sequence.buckets", 8: "sequence.shared_set"}  # k = 8: every example has every head
    chosen = get_executor("gathered").prepare(w, AttentionInputs(x=x), plan).strategy
    assert chosen == strategies.get(k, "sequence.one_bucket")
    y = check(w, AttentionInputs(x=x), plan, {**leaves, "gates": gates})
    if k == 0:
        assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("Hkv", [8, 2])
def test_sequence_same_head_set_for_every_example(Hkv: int) -> None:
    """Every example chose heads {1, 4, 5}: one k-head block on shared weight slices (no per-example gather)."""
    w, x, leaves = setup(Hkv=Hkv, causal=True)
    active = torch.zeros(6, 8, dtype=torch.bool)
    active[:, [1, 4, 5]] = True
    plan, gates = leaf_plan(active)
    assert gather_sizes(w, AttentionInputs(x=x), plan).shared_heads == (1, 4, 5)
    assert get_executor("gathered").prepare(w, AttentionInputs(x=x), plan).strategy == "sequence.shared_set"
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[2, 3:] = False
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask, rotary=rotary_tables(6, 7, 4, torch.float64))
    check(w, inputs, plan, {**leaves, "gates": gates})


@pytest.mark.parametrize("path", ["grouped", "buckets"])
@pytest.mark.parametrize("Hkv", [8, 2])
def test_sequence_rotary_kv_cache_and_bias(Hkv: int, path: str) -> None:
    """Rotary tables indexed per example, a KV cache (bottom-right causal) and a per-head additive bias."""
    gathered = sequence_strategy(path)
    w, x, leaves = setup(Hkv=Hkv, causal=True)
    B, T, S = 6, 7, 10
    ks_ = torch.randn(B, Hkv, S, 4, dtype=torch.float64).requires_grad_()
    vs_ = torch.randn(B, Hkv, S, 4, dtype=torch.float64).requires_grad_()
    bias = torch.randn(B, 8, T, S, dtype=torch.float64)
    bias[2, :, 3] = float("-inf")  # a dead query row in every head
    bias = bias.requires_grad_()
    plan, gates = leaf_plan(seq_active([2, 0, 8, 1, 2, 5], 8))
    inputs = AttentionInputs(x=x, key_states=ks_, value_states=vs_, attn_bias=bias,
                             rotary=rotary_tables(B, T, 4, torch.float64))
    y = check(w, inputs, plan, {**leaves, "gates": gates, "key_states": ks_, "value_states": vs_, "attn_bias": bias},
              gathered)
    assert torch.equal(y[2, 3], torch.zeros_like(y[2, 3]))
    check(w, AttentionInputs(x=x, rotary=rotary_tables(B, T, 4, torch.float64)), plan, {**leaves, "gates": gates},
          gathered)


@pytest.mark.parametrize("path", ["grouped", "buckets"])
@pytest.mark.parametrize("one_source", [False, True])
def test_sequence_cross_attention(path: str, one_source: bool) -> None:
    """Cross-attention with GQA: keys and values from separate tensors (widths 12 and 10), or both from one
    (then grouped GEMMs project them together), S != T, a key padding mask with an all-padding example."""
    gathered = sequence_strategy(path)
    B, T, S = 4, 5, 8
    w = make_weights(make_layout(H=4, Hkv=2, Dh=4, D=16, kdim=12, vdim=12 if one_source else 10))
    x = torch.randn(B, T, 16, dtype=torch.float64).requires_grad_()
    key = torch.randn(B, S, 12, dtype=torch.float64).requires_grad_()
    value = None if one_source else torch.randn(B, S, 10, dtype=torch.float64).requires_grad_()
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[1, 5:] = False
    key_mask[3] = False
    plan, gates = leaf_plan(seq_active([2, 0, 3, 1], 4))
    leaves = {"x": x, "key": key, "gates": gates, **weight_leaves(w), **({} if value is None else {"value": value})}
    y = check(w, AttentionInputs(x=x, key=key, value=value, key_mask=key_mask), plan, leaves, gathered)
    assert torch.equal(y[3], torch.zeros_like(y[3]))  # no key to attend to: exactly zero


@pytest.fixture(params=["by_set", "per_head"])
def routed_path(request: pytest.FixtureRequest) -> GatheredExecutor:
    """The gathered executor with the routed heads projected per head set (size rule lifted), then per head."""
    return GatheredExecutor(tuning=TOY, strategy=f"token.{request.param}")


@pytest.mark.parametrize("Hkv", [8, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_token_moh_shared_dense_and_routed(Hkv: int, causal: bool, routed_path: GatheredExecutor) -> None:
    """2 shared heads (run densely) + top-2 of 6 routed heads (gathered), with padding and rotary."""
    B, T = 5, 9
    w, x, leaves = setup(B=B, T=T, Hkv=Hkv, causal=causal)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    mask[3] = False  # an all-padding example: exactly zero output
    plan, gates = leaf_plan(moh_active(B, T, 8, 2, 2, mask))
    rows = gather_sizes(w, AttentionInputs(x=x), plan).rows_per_head
    assert rows[0] == T and all(r < CPU.dense_head_rows * T for r in rows[2:])  # both paths are exercised
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask, rotary=rotary_tables(B, T, 4, torch.float64))
    y = check(w, inputs, plan, {**leaves, "gates": gates}, routed_path)
    assert torch.equal(y[3], torch.zeros_like(y[3]))


@pytest.mark.parametrize("idle_row", [False, True])
def test_token_output_bias_only_on_rows_with_a_head(idle_row: bool) -> None:
    """With every row active, the output bias is folded into the dense block's projection; a row that chose no
    head (head 0 is still dense: 39 of 40 rows) must get neither bias nor anything else: exactly zero."""
    B, T = 4, 10
    w, x, leaves = setup(B=B, T=T)
    assert w.o_bias is not None
    active = moh_active(B, T, 8, 1, 1)
    if idle_row:
        active[1, 3] = False
    plan, gates = leaf_plan(active)
    sizes = gather_sizes(w, AttentionInputs(x=x), plan)
    assert sizes.every_row_active is not idle_row and sizes.rows_per_head[0] >= CPU.dense_head_rows * T
    y = check(w, AttentionInputs(x=x), plan, {**leaves, "gates": gates})
    if idle_row:
        assert torch.equal(y[1, 3], torch.zeros_like(y[1, 3]))


def test_token_kv_cache_bias_and_unused_heads(routed_path: GatheredExecutor) -> None:
    """Token plan with a KV cache, a per-head additive bias, and heads no token chose (their K/V skipped)."""
    B, T, S = 4, 6, 9
    w, x, leaves = setup(B=B, T=T, Hkv=4, causal=True)
    active = top_k_mask(torch.rand(B, T, 8), torch.randint(0, 4, (B, T)))
    active[..., 6:] = False  # heads 6, 7 (key/value head 3) unused by every token
    ks_ = torch.randn(B, 4, S, 4, dtype=torch.float64).requires_grad_()
    vs_ = torch.randn(B, 4, S, 4, dtype=torch.float64).requires_grad_()
    bias = torch.randn(1, 8, T, S, dtype=torch.float64).requires_grad_()
    plan, gates = leaf_plan(active)
    inputs = AttentionInputs(x=x, key_states=ks_, value_states=vs_, attn_bias=bias)
    check(w, inputs, plan, {**leaves, "gates": gates, "key_states": ks_, "value_states": vs_, "attn_bias": bias},
          routed_path)


def test_token_cross_attention(routed_path: GatheredExecutor) -> None:
    B, T, S = 3, 5, 8
    w = make_weights(make_layout(H=4, Hkv=2, Dh=4, D=16, kdim=12, vdim=10))
    x = torch.randn(B, T, 16, dtype=torch.float64).requires_grad_()
    key = torch.randn(B, S, 12, dtype=torch.float64).requires_grad_()
    value = torch.randn(B, S, 10, dtype=torch.float64).requires_grad_()
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[1, 5:] = False
    plan, gates = leaf_plan(top_k_mask(torch.rand(B, T, 4), 2))
    leaves = {"x": x, "key": key, "value": value, "gates": gates, **weight_leaves(w)}
    check(w, AttentionInputs(x=x, key=key, value=value, key_mask=key_mask), plan, leaves, routed_path)


def test_token_head_sets_are_counted_and_many_heads_run_per_head() -> None:
    """The sizes' head-set histogram equals a Python count of each row's heads; past ``max_set_heads`` heads
    there is none, and the routed heads run per head (still equal to the reference)."""
    B, T = 3, 11
    w, x, leaves = setup(B=B, T=T)
    active = moh_active(B, T, 8, 1, 3)
    active[0, 2] = False  # a row with no head at all
    counts: dict[int, int] = {}
    for row in active.reshape(-1, 8).tolist():
        key = sum(1 << h for h, a in enumerate(row) if a)
        counts[key] = counts.get(key, 0) + 1
    plan, gates = leaf_plan(active)
    assert gather_sizes(w, AttentionInputs(x=x), plan, TOY).head_sets == tuple(sorted(counts.items()))
    sets = ((0b1011, 4), (0b0011, 2), (0b1001, 1), (0b0001, 5))  # heads 1 and 3 routed: masks 11, 01, 10, 00
    assert routed_head_sets(sets, [1, 3]) == [(0b00, 5), (0b01, 2), (0b10, 1), (0b11, 4)]
    assert routed_head_sets(sets, [1, 3], limit=3) is not None  # the empty set does not count
    assert routed_head_sets(sets, [1, 3], limit=2) is None
    H = CPU.max_set_heads + 2
    w, x, leaves = setup(B=B, T=T, H=H, D=4 * H)
    plan, gates = leaf_plan(moh_active(B, T, H, 2, 3))
    assert gather_sizes(w, AttentionInputs(x=x), plan, TOY).head_sets == ()
    toy = GatheredExecutor(tuning=TOY)
    assert toy.prepare(w, AttentionInputs(x=x), plan).strategy == "token.per_head"
    check(w, AttentionInputs(x=x), plan, {**leaves, "gates": gates}, toy)


def test_per_set_strategy_only_for_large_sets() -> None:
    """The size rule with the CPU bound: mean rows per non-empty set times the width against ``min_set_work``.
    MoH top-2 of 6 at B*T = 4096 (15 sets of about 273 rows): per set at width 512 (about 140,000), per head at
    width 256 (about 70,000); no routed row: never. A call too small for any set has no histogram at all."""
    by_set = get_strategy("token.by_set")
    sets = ((0, 10),) + tuple((m, 273) for m in range(64) if bin(m).count("1") == 2)  # 15 two-head sets
    for width, runs in ((512, True), (256, False)):
        w = make_weights(make_layout(H=6, Dh=width // 8, D=width), torch.float32)
        x = torch.empty(1, 4096, width)
        plan, _ = leaf_plan(moh_active(1, 4096, 6, 0, 2))
        sizes = GatherSizes("token", rows_per_head=(1000,) * 6, head_sets=sets)
        reasons = by_set.supports(GatheredCall(w, AttentionInputs(x=x), plan, sizes, CPU))
        assert (reasons == []) is runs and (runs or "min_set_work" in reasons[0])
        sizes = GatherSizes("token", rows_per_head=(1000,) * 6, head_sets=((0, 4096),))
        assert by_set.supports(GatheredCall(w, AttentionInputs(x=x), plan, sizes, CPU))
    w, x, _ = setup(B=3, T=11)  # B*T*D = 792: no set could pass, so the sizes read has no histogram either
    plan, _ = leaf_plan(moh_active(3, 11, 8, 1, 3))
    assert gather_sizes(w, AttentionInputs(x=x), plan, CPU).head_sets == ()


@pytest.mark.parametrize("n_true", [0, 1, 37, 200])
def test_compact_is_nonzero_without_a_host_read(n_true: int) -> None:
    selected = torch.zeros(200, dtype=torch.bool)
    selected[torch.randperm(200)[:n_true]] = True
    assert torch.equal(_compact(selected, n_true), selected.nonzero().squeeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_low_precision(dtype: torch.dtype, granularity: str) -> None:
    B, T = 4, 16
    w, x, leaves = setup(B=B, T=T, Dh=8, D=32, dtype=dtype, causal=True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 10:] = False
    active = seq_active([2, 4, 1, 8], 8) if granularity == "sequence" else moh_active(B, T, 8, 2, 2, mask)
    plan, gates = leaf_plan(active, dtype)
    check(w, AttentionInputs(x=x, mask=mask, key_mask=mask), plan, {**leaves, "gates": gates})


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_dropout_is_applied_and_differentiable(granularity: str) -> None:
    """Dropout draws its own mask (no reference to equal), so: p=0 matches, p>0 changes outputs, grads finite."""
    w, x, leaves = setup(B=4, T=8)
    active = seq_active([2, 3, 8, 1], 8) if granularity == "sequence" else moh_active(4, 8, 8, 2, 2)
    plan, _ = leaf_plan(active)
    ex = get_executor("gathered")
    y0 = ex(w, AttentionInputs(x=x), plan)
    torch.testing.assert_close(y0, get_executor("reference")(w, AttentionInputs(x=x), plan))
    y = ex(w, AttentionInputs(x=x, dropout_p=0.5), plan)
    assert not torch.allclose(y, y0)
    grads = torch.autograd.grad(y.sum(), [x, w.q_weight])
    assert all(torch.isfinite(g).all() for g in grads)


def test_supports_names_the_problem() -> None:
    w, x, _ = setup(dtype=torch.float32)
    plan, _ = leaf_plan(seq_active([1] * 6, 8))
    ex = get_executor("gathered")
    reason = ex.supports(w, AttentionInputs(x=x.detach().double()), plan)
    assert reason is not None and "float32" in reason and "float64" in reason
    reason = ex.supports(w, AttentionInputs(x=x.detach().long()), plan)
    assert reason is not None and "dtype" in reason

