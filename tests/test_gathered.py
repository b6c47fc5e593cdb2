"""The gathered executor against the per-head reference on the situations its packing has to get right.

The registry-driven suite (test_core_executors.py) already compares it on the common cases; these add the
paths specific to packing: the sequence plans' grouped GEMMs and buckets (each forced in turn), several (k, k_kv)
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
    rotary_tables,
    run_and_grads,
    weight_leaves,
)
from torch import Tensor

from condcomp.executors import gathered as gathered_module
from condcomp.executors import gathered_pairs, gathered_token, grouped_gemm
from condcomp.executors.auto import get_executor
from condcomp.executors.base import qkv_head_rows
from condcomp.executors.gathered import gather_sizes
from condcomp.executors.gathered_token import DENSE_HEAD_ROWS
from condcomp.plans import top_k_mask
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

TOL = {**TOLERANCES, torch.float16: (3e-2, 3e-2)}


def check(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, leaves: dict[str, Tensor]) -> Tensor:
    """Assert gathered == reference on outputs and on the gradients of every leaf; returns gathered's output."""
    dtype = inputs.x.dtype
    atol, rtol = TOL[dtype]
    probe = torch.randn(inputs.x.shape[0], inputs.x.shape[1], w.layout.d_model, dtype=torch.float64).to(dtype)
    gathered = get_executor("gathered")
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


def seq_active(ks: list[int], H: int) -> Tensor:
    return top_k_mask(torch.rand(len(ks), H), torch.tensor(ks))


def moh_active(B: int, T: int, H: int, shared: int, top: int, mask: Tensor | None = None) -> Tensor:
    """MoH-style: the first ``shared`` heads always, plus the top ``top`` of the others per token."""
    routed = top_k_mask(torch.rand(B, T, H - shared), top)
    active = torch.cat([torch.ones(B, T, shared, dtype=torch.bool), routed], -1)
    return active if mask is None else active & mask.unsqueeze(-1)


def use_sequence_path(path: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Force the path variable-k sequence plans take in the fused layout: ``grouped`` (grouped GEMMs, the default
    on CPU with MKL), ``buckets`` (batched matmuls per bucket, the default elsewhere), or the packed pairs with
    the output projection ``padded`` per example or ``scatter``-ed per pair. Returns the list the grouped path
    appends to when it runs."""
    if path == "grouped" and not grouped_gemm.available(torch.zeros(1)):
        pytest.skip("this torch build exports no MKL cblas_?gemm_batch (only x86 builds with MKL do)")
    monkeypatch.setattr(grouped_gemm, "ENABLED", path == "grouped")
    monkeypatch.setattr(gathered_module, "PACK_PAIRS", path in ("padded", "scatter"))
    monkeypatch.setattr(gathered_pairs, "PAD_LIMIT", 100.0 if path == "padded" else 0.0)
    ran: list[str] = []
    real = gathered_module.sequence_pairs_grouped

    def spy(*args: object) -> Tensor:
        ran.append("grouped")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gathered_module, "sequence_pairs_grouped", spy)
    return ran


@pytest.mark.parametrize(("Hkv", "path", "causal"), [(8, "grouped", False), (8, "grouped", True), (4, "grouped", True),
                                                     (2, "grouped", False), (8, "padded", False), (8, "scatter", True),
                                                     (8, "buckets", False), (8, "buckets", True), (4, "buckets", True),
                                                     (2, "buckets", False)])
def test_sequence_many_buckets(Hkv: int, path: str, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Variable k (0, 1, 3, 3, 5, H) and, with GQA, variable key/value head counts: several buckets in one call.

    Grouped GEMMs over the pairs (with GQA: keys and values once per example and key/value head), or, forced,
    one block per bucket, or (fused layout only) packed pairs with the output projection padded per example or
    scattered per pair.
    """
    ran = use_sequence_path(path, monkeypatch)
    w, x, leaves = setup(Hkv=Hkv, causal=causal)
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[1, 5:] = False
    mask[4, :2] = False
    plan, gates = leaf_plan(seq_active([0, 1, 3, 3, 5, 8], 8))
    sizes = gather_sizes(w, AttentionInputs(x=x), plan)
    assert sum(n for _, _, n in sizes.buckets) == 6 and len(sizes.buckets) >= 5
    y = check(w, AttentionInputs(x=x, mask=mask, key_mask=mask), plan, {**leaves, "gates": gates})
    assert torch.equal(y[0], torch.zeros_like(y[0]))  # k = 0: exactly zero, no output bias
    assert bool(ran) == (path == "grouped")


@pytest.mark.parametrize("path", ["grouped", "buckets", "padded", "scatter"])
@pytest.mark.parametrize("drop_key_bias", [False, True])
def test_sequence_fused_in_projection_and_missing_key_bias(path: str, drop_key_bias: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v sliced from one in-projection are gathered from it directly (gradients reach the fused leaf), and a
    missing key bias counts as zeros while the query and value biases still apply (they were once dropped)."""
    ran = use_sequence_path(path, monkeypatch)
    w, x, _ = setup()
    w, leaves = fused_qkv_weights(replace(w, k_bias=None) if drop_key_bias else w)
    plan, gates = leaf_plan(seq_active([0, 1, 3, 3, 5, 8], 8))
    check(w, AttentionInputs(x=x), plan, {"x": x, **leaves, "gates": gates})
    assert bool(ran) == (path == "grouped")


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
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[2, 3:] = False
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask, rotary=rotary_tables(6, 7, 4, torch.float64))
    check(w, inputs, plan, {**leaves, "gates": gates})


@pytest.mark.parametrize("path", ["grouped", "buckets"])
@pytest.mark.parametrize("Hkv", [8, 2])
def test_sequence_rotary_kv_cache_and_bias(Hkv: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotary tables indexed per example, a KV cache (bottom-right causal) and a per-head additive bias."""
    ran = use_sequence_path(path, monkeypatch)
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
    y = check(w, inputs, plan, {**leaves, "gates": gates, "key_states": ks_, "value_states": vs_, "attn_bias": bias})
    assert torch.equal(y[2, 3], torch.zeros_like(y[2, 3]))
    x2, leaves2 = x, {**leaves, "gates": gates}
    check(w, AttentionInputs(x=x2, rotary=rotary_tables(B, T, 4, torch.float64)), plan, leaves2)
    assert len(ran) == (2 if path == "grouped" else 0)  # one gathered call per check


@pytest.mark.parametrize("path", ["grouped", "buckets"])
@pytest.mark.parametrize("one_source", [False, True])
def test_sequence_cross_attention(path: str, one_source: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cross-attention with GQA: keys and values from separate tensors (widths 12 and 10), or both from one
    (then grouped GEMMs project them together), S != T, a key padding mask with an all-padding example."""
    ran = use_sequence_path(path, monkeypatch)
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
    y = check(w, AttentionInputs(x=x, key=key, value=value, key_mask=key_mask), plan, leaves)
    assert torch.equal(y[3], torch.zeros_like(y[3]))  # no key to attend to: exactly zero
    assert bool(ran) == (path == "grouped")


@pytest.fixture(params=["by_set", "per_head"])
def routed_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Runs a token test with the routed heads projected per head set, then (forced) per head; the returned
    list records which of the two ran, so a test can check it exercised the path it names."""
    calls: list[str] = []
    for name, label in (("_routed_by_set", "by_set"), ("_routed", "per_head")):
        real = getattr(gathered_token, name)
        monkeypatch.setattr(gathered_token, name,
                            lambda *a, _real=real, _label=label: (calls.append(_label), _real(*a))[1])
    if request.param == "per_head":
        monkeypatch.setattr(gathered_token, "MAX_HEAD_SETS", 0)
    calls.append(request.param)  # first entry: the path asked for
    return calls


def ran(calls: list[str]) -> bool:
    """The token test's routed heads ran only on the path ``routed_path`` asked for (and at least once)."""
    return len(calls) > 1 and set(calls[1:]) == {calls[0]}


@pytest.mark.parametrize("Hkv", [8, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_token_moh_shared_dense_and_routed(Hkv: int, causal: bool, routed_path: list[str]) -> None:
    """2 shared heads (run densely) + top-2 of 6 routed heads (gathered), with padding and rotary."""
    B, T = 5, 9
    w, x, leaves = setup(B=B, T=T, Hkv=Hkv, causal=causal)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    mask[3] = False  # an all-padding example: exactly zero output
    plan, gates = leaf_plan(moh_active(B, T, 8, 2, 2, mask))
    rows = gather_sizes(w, AttentionInputs(x=x), plan).rows_per_head
    assert rows[0] == T and all(r < DENSE_HEAD_ROWS * T for r in rows[2:])  # both paths are exercised
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask, rotary=rotary_tables(B, T, 4, torch.float64))
    y = check(w, inputs, plan, {**leaves, "gates": gates})
    assert torch.equal(y[3], torch.zeros_like(y[3]))
    assert ran(routed_path)


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
    assert sizes.every_row_active is not idle_row and sizes.rows_per_head[0] >= DENSE_HEAD_ROWS * T
    y = check(w, AttentionInputs(x=x), plan, {**leaves, "gates": gates})
    if idle_row:
        assert torch.equal(y[1, 3], torch.zeros_like(y[1, 3]))


def test_token_kv_cache_bias_and_unused_heads(routed_path: list[str]) -> None:
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
    check(w, inputs, plan, {**leaves, "gates": gates, "key_states": ks_, "value_states": vs_, "attn_bias": bias})
    assert ran(routed_path)


def test_token_cross_attention(routed_path: list[str]) -> None:
    B, T, S = 3, 5, 8
    w = make_weights(make_layout(H=4, Hkv=2, Dh=4, D=16, kdim=12, vdim=10))
    x = torch.randn(B, T, 16, dtype=torch.float64).requires_grad_()
    key = torch.randn(B, S, 12, dtype=torch.float64).requires_grad_()
    value = torch.randn(B, S, 10, dtype=torch.float64).requires_grad_()
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[1, 5:] = False
    plan, gates = leaf_plan(top_k_mask(torch.rand(B, T, 4), 2))
    leaves = {"x": x, "key": key, "value": value, "gates": gates, **weight_leaves(w)}
    check(w, AttentionInputs(x=x, key=key, value=value, key_mask=key_mask), plan, leaves)
    assert ran(routed_path)


def test_token_head_sets_are_counted_and_many_heads_run_per_head() -> None:
    """The sizes' head-set histogram equals a Python count of each row's heads; past ``MAX_SET_HEADS`` heads
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
    assert gather_sizes(w, AttentionInputs(x=x), plan).head_sets == tuple(sorted(counts.items()))
    sets = ((0b1011, 4), (0b0011, 2), (0b1001, 1), (0b0001, 5))  # heads 1 and 3 routed: masks 11, 01, 10, 00
    assert gathered_token.routed_head_sets(sets, [1, 3]) == [(0b00, 5), (0b01, 2), (0b10, 1), (0b11, 4)]
    assert gathered_token.routed_head_sets(sets, [1, 3], limit=3) is not None  # the empty set does not count
    assert gathered_token.routed_head_sets(sets, [1, 3], limit=2) is None
    H = gathered_module.MAX_SET_HEADS + 2
    w, x, leaves = setup(B=B, T=T, H=H, D=4 * H)
    plan, gates = leaf_plan(moh_active(B, T, H, 2, 3))
    assert gather_sizes(w, AttentionInputs(x=x), plan).head_sets == ()
    check(w, AttentionInputs(x=x), plan, {**leaves, "gates": gates})


def test_per_set_path_only_for_large_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size rule, with the documented bound (the conftest fixture lifts it for the other tests): mean rows
    per non-empty set times the width against ``MIN_SET_WORK``. MoH top-2 of 6 at B*T = 4096 (15 sets of about
    273 rows): per set at width 512 (about 140,000), per head at width 256 (about 70,000); no routed row: never."""
    monkeypatch.setattr(gathered_token, "MIN_SET_WORK", 100_000)
    sets = [(0, 10)] + [(m, 273) for m in range(1, 16)]
    assert gathered_token.per_set_pays(sets, 512) and not gathered_token.per_set_pays(sets, 256)
    assert not gathered_token.per_set_pays([(0, 4096)], 512)
    w, x, _ = setup(B=3, T=11)  # B*T*D = 792: no set could pass, so the sizes read has no histogram either
    plan, _ = leaf_plan(moh_active(3, 11, 8, 1, 3))
    assert gather_sizes(w, AttentionInputs(x=x), plan).head_sets == ()


@pytest.mark.parametrize("n_true", [0, 1, 37, 200])
def test_compact_is_nonzero_without_a_host_read(n_true: int) -> None:
    selected = torch.zeros(200, dtype=torch.bool)
    selected[torch.randperm(200)[:n_true]] = True
    assert torch.equal(gathered_token._compact(selected, n_true), selected.nonzero().squeeze(1))


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

