"""The grouped GEMMs over pointer lists (MKL's cblas_?gemm_batch through ctypes) against torch.

References are independent of the batch call: ``torch.mm`` per GEMM, Python loops over the pairs, and
``torch.autograd.gradcheck`` (finite differences in float64) for the two differentiable pair ops. The whole module
skips where the torch build exports no ``cblas_?gemm_batch`` (non-x86 builds without MKL): the gathered executor
then keeps its batched-matmul path, which test_gathered.py covers on its own.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from core_helpers import leaf_plan, make_layout, make_weights
from torch import Tensor

from condcomp.executors import grouped_gemm
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import CPU, GatheredExecutor
from condcomp.executors.grouped_gemm import gemm_batch, pair_output, pair_projection, rounds
from condcomp.plans import top_k_mask
from condcomp.types import AttentionInputs

pytestmark = pytest.mark.skipif(not grouped_gemm.available(torch.zeros(1)),
                                reason="this torch build exports no MKL cblas_?gemm_batch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm_batch_matches_mm_at_offsets_and_leading_dims(dtype: torch.dtype, trans_a: bool, trans_b: bool,
                                                           beta: float) -> None:
    """Each GEMM reads a sub-matrix of a larger tensor (rows ``ld`` apart, wider than the matrix) at its own
    offset, and adds into its own sub-matrix of C; the rest of C is untouched."""
    m, n, k, count = 5, 3, 7, 4
    gen = torch.Generator().manual_seed(1)
    a_rows, a_cols = (k, m) if trans_a else (m, k)
    b_rows, b_cols = (n, k) if trans_b else (k, n)
    A = torch.randn(count, a_rows, a_cols + 2, generator=gen, dtype=dtype)  # ld = cols + 2: padded rows
    Bm = torch.randn(count + 1, b_rows, b_cols + 3, generator=gen, dtype=dtype)
    C = torch.randn(count, m, n + 1, generator=gen, dtype=dtype)
    before = C.clone()
    pick_b = torch.tensor([3, 0, 3, 1])  # a B matrix may serve several GEMMs
    gemm_batch(A, torch.arange(count) * A[0].numel(), a_cols + 2, trans_a,
               Bm, pick_b * Bm[0].numel(), b_cols + 3, trans_b,
               C, torch.arange(count) * C[0].numel(), n + 1, m, n, k, beta=beta)
    for i in range(count):
        a = A[i, :, :a_cols]
        b = Bm[pick_b[i], :, :b_cols]
        want = (a.t() if trans_a else a) @ (b.t() if trans_b else b) + beta * before[i, :, :n]
        torch.testing.assert_close(C[i, :, :n], want)
        assert torch.equal(C[i, :, n], before[i, :, n])  # the padding column is not written


@pytest.mark.parametrize("keys", [[0, 0, 1, 2, 2, 2, 1], [3], [], [5, 5, 5, 5], [0, 1, 2, 3]])
def test_rounds_put_each_key_once_per_round_in_order(keys: list[int]) -> None:
    t = torch.tensor(keys, dtype=torch.long)
    order, sizes = rounds(t)
    assert sorted(order.tolist()) == list(range(len(keys)))  # every position exactly once
    assert sum(sizes) == len(keys) and len(sizes) == (max(keys.count(k) for k in keys) if keys else 0)
    start = 0
    for r, n in enumerate(sizes):
        idx = order[start:start + n].tolist()
        start += n
        ks = [keys[pos] for pos in idx]
        assert len(ks) == len(set(ks)) and ks == sorted(ks)  # no key twice in a round, in key order
        for pos, key in zip(idx, ks):  # round r holds the r-th occurrence of its key
            assert keys[:pos].count(key) == r


def test_gemm_batch_chunks_accumulate_in_order() -> None:
    """Three GEMMs adding into the same C, one per chunk: C = C0 + sum of the products."""
    gen = torch.Generator().manual_seed(4)
    A, Bm, C = (torch.randn(3, 4, 5, generator=gen), torch.randn(3, 5, 2, generator=gen),
                torch.randn(1, 4, 2, generator=gen))
    want = C[0] + sum(A[i] @ Bm[i] for i in range(3))
    gemm_batch(A, torch.arange(3) * 20, 5, False, Bm, torch.arange(3) * 10, 2, False, C, torch.zeros(3).long(), 2,
               4, 2, 5, beta=1.0, chunks=[1, 1, 1])
    torch.testing.assert_close(C[0], want)


def pairs_of(B: int, H: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random (example, head) pairs in example order, examples with 0 .. H heads (one with none)."""
    ks = torch.randint(0, H + 1, (B,), generator=gen)
    ks[0] = 0
    active = top_k_mask(torch.rand(B, H, generator=gen), ks)
    pid = active.reshape(-1).nonzero().squeeze(1)
    return torch.div(pid, H, rounding_mode="floor"), pid % H


def test_pair_ops_forward_against_loops() -> None:
    gen = torch.Generator().manual_seed(2)
    B, T, D, H, N, Dh = 5, 6, 7, 4, 9, 3
    b_idx, h_idx = pairs_of(B, H, gen)
    x, w, bias = torch.randn(B, T, D, generator=gen), torch.randn(H, N, D, generator=gen), torch.randn(H, N)
    got = pair_projection(x, w, bias, b_idx, h_idx)
    for p, (b, h) in enumerate(zip(b_idx.tolist(), h_idx.tolist())):
        torch.testing.assert_close(got[p], x[b] @ w[h].t() + bias[h])
    torch.testing.assert_close(pair_projection(x, w, None, b_idx, h_idx), got - bias[h_idx][:, None])
    o, w_o, base = torch.randn(len(b_idx), T, Dh), torch.randn(D, H * Dh), torch.randn(B, T, D)
    want = base.clone()
    for p, (b, h) in enumerate(zip(b_idx.tolist(), h_idx.tolist())):
        want[b] += o[p] @ w_o[:, h * Dh:(h + 1) * Dh].t()
    torch.testing.assert_close(pair_output(o, w_o, base, b_idx, h_idx), want)
    torch.testing.assert_close(pair_output(o, w_o, base[:1].expand(B, T, D), b_idx, h_idx),
                               want - base + base[:1])  # an expanded base is read, never written


def test_pair_ops_gradients_by_finite_differences() -> None:
    gen = torch.Generator().manual_seed(3)
    B, T, D, H, N, Dh = 4, 3, 5, 3, 4, 2
    b_idx, h_idx = pairs_of(B, H, gen)
    P = len(b_idx)

    def leaf(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    assert torch.autograd.gradcheck(lambda x, w, b: pair_projection(x, w, b, b_idx, h_idx),
                                    (leaf(B, T, D), leaf(H, N, D), leaf(H, N)))
    assert torch.autograd.gradcheck(lambda o, w_o, base: pair_output(o, w_o, base, b_idx, h_idx),
                                    (leaf(P, T, Dh), leaf(D, H * Dh), leaf(B, T, D)))


@pytest.mark.parametrize(("dtype", "Hkv", "autocast", "grouped"), [
    (torch.float64, 8, False, True), (torch.float32, 8, False, True), (torch.bfloat16, 8, False, False),
    (torch.float64, 2, False, True), (torch.float32, 8, True, False)])
def test_executor_takes_grouped_gemms_only_where_they_run(dtype: torch.dtype, Hkv: int, autocast: bool,
                                                          grouped: bool) -> None:
    """float32/float64, with or without GQA: grouped GEMMs. bfloat16 (MKL has no batch GEMM for it) and CPU
    autocast: the batched-matmul buckets. The answer matches the reference either way."""
    w = make_weights(make_layout(H=8, Hkv=Hkv, Dh=4, D=24), dtype)
    x = torch.randn(6, 7, 24, dtype=torch.float64).to(dtype)
    plan, _ = leaf_plan(top_k_mask(torch.rand(6, 8), torch.tensor([0, 1, 3, 3, 5, 8])), dtype)
    with torch.no_grad():
        want = get_executor("reference")(w, AttentionInputs(x=x), plan).float()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            run = get_executor("gathered").prepare(w, AttentionInputs(x=x), plan)
            got = run(w, AttentionInputs(x=x), plan).float()
    tol = 3e-2 if dtype == torch.bfloat16 or autocast else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert (run.strategy == "sequence.grouped") == grouped


def test_falls_back_when_the_library_has_no_batch_gemm() -> None:
    """A torch without the MKL symbol (or one failing the self-test) detects no dtype; with grouped GEMMs off the
    executor takes the batched-matmul buckets, same answers."""
    assert grouped_gemm._detect(symbol=lambda dtype: None) == frozenset()
    assert grouped_gemm._detect() == {torch.float32, torch.float64}
    assert grouped_gemm._detect(self_test=lambda dtype: dtype != torch.float64) == {torch.float32}
    w = make_weights(make_layout(H=8, Dh=4, D=24), torch.float64)
    x = torch.randn(6, 7, 24, dtype=torch.float64)
    plan, _ = leaf_plan(top_k_mask(torch.rand(6, 8), torch.tensor([0, 1, 3, 3, 5, 8])))
    want = get_executor("reference")(w, AttentionInputs(x=x), plan)
    run = GatheredExecutor(tuning=replace(CPU, grouped_gemm=False)).prepare(w, AttentionInputs(x=x), plan)
    assert run.strategy == "sequence.buckets"
    torch.testing.assert_close(run(w, AttentionInputs(x=x), plan), want)


@pytest.mark.slow
def test_self_test_runs_at_first_use_not_at_import() -> None:
    """``import condcomp`` loads no library and runs no GEMM; ``ENABLED = False`` never runs the self-test."""
    code = ("import torch, condcomp; from condcomp.executors import grouped_gemm as g; assert g._READY is None; "
            "g.ENABLED = False; assert not g.available(torch.zeros(1)); assert g._READY is None; "
            "g.ENABLED = True; assert g.available(torch.zeros(1)) and g._READY")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("min_copy", [0, 10**9])
def test_one_bucket_plans_take_grouped_gemms_only_when_the_block_would_copy_enough(min_copy: int) -> None:
    """Every example with k = 3 (different heads): the single batched block unless the weights it would gather
    reach ``min_grouped_copy``; plans with several k take the grouped GEMMs at any size. Both equal the reference."""
    gathered = GatheredExecutor(tuning=replace(CPU, min_grouped_copy=min_copy))
    w = make_weights(make_layout(H=8, Dh=4, D=24), torch.float64)
    x = torch.randn(6, 7, 24, dtype=torch.float64)
    for ks, grouped in (([3] * 6, min_copy == 0), ([1, 3, 3, 2, 3, 3], True)):
        plan, _ = leaf_plan(top_k_mask(torch.rand(6, 8), torch.tensor(ks)))
        want = get_executor("reference")(w, AttentionInputs(x=x), plan)
        run = gathered.prepare(w, AttentionInputs(x=x), plan)
        torch.testing.assert_close(run(w, AttentionInputs(x=x), plan), want)
        assert (run.strategy == "sequence.grouped") == grouped
