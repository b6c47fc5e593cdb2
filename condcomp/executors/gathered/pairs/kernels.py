"""The three Triton kernels of the pair ops; imported only when a kernel launches (it imports triton).

Every kernel reads the example's head ids ``heads (B, C)`` and counts ``counts (B,)`` inside the program: the grid is
fixed by the cap ``C``, a pair ``j >= counts[b]`` writes zeros or is skipped, and weights are read in place through
their strides (no per-example copy). Accumulation is float32; nothing uses atomics, so every result is deterministic.

- :func:`pair_matmul`: ``out[b, j] = scale[b, j] * (x[b] @ w[h]^T + bias[h])`` with ``h = heads[b, j]`` (DejaVu's
  ``qkv_proj_sparse``): the pair projection, and the output projection's input gradient.
- :func:`pair_sum`: ``y[b] = sum_{j < counts[b]} scale[b, j] * a[b, j] @ w[h] (+ bias where counts[b] > 0)`` (DejaVu's
  ``out_proj_sparse``, the loop over the example's heads inside one program): the output projection, and the pair
  projection's input gradient.
- :func:`group_xty`: ``dw[e] = sum over pairs of head e of scale * g[b, j]^T @ x[b]`` and ``dbias[e]`` (ScatterMoE's
  ``groupXtY``): pairs sorted by head once, each program owns one head's tile and loops over that head's pairs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pair_matmul(x_ptr, w_ptr, bias_ptr, scale_ptr, heads_ptr, counts_ptr, out_ptr,
                T, F, D, C,
                sxb, sxt, sxd, swe, swf, swd, sbe, sbf, ssb, ssc, shb, shc, sob, soc, sot, sof,
                HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # grid (B * C, cdiv(T, BM), cdiv(F, BN)); x (B, T, D), w (E, F, D), out (B, C, T, F)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // C
    j = pid % C
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    count = tl.load(counts_ptr + b)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if j < count:
        h = tl.load(heads_ptr + b * shb + j * shc)
        offs_k = tl.arange(0, BK)
        for k0 in range(0, D, BK):
            kk = k0 + offs_k
            xt = tl.load(x_ptr + b * sxb + offs_m[:, None] * sxt + kk[None, :] * sxd,
                         mask=(offs_m[:, None] < T) & (kk[None, :] < D), other=0.0)  # (BM, BK)
            wt = tl.load(w_ptr + h * swe + offs_n[None, :] * swf + kk[:, None] * swd,
                         mask=(offs_n[None, :] < F) & (kk[:, None] < D), other=0.0)  # (BK, BN)
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + h * sbe + offs_n * sbf, mask=offs_n < F, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + b * ssb + j * ssc).to(tl.float32)
    out_ptrs = out_ptr + b * sob + j * soc + offs_m[:, None] * sot + offs_n[None, :] * sof
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < F))


@triton.jit
def pair_sum(a_ptr, w_ptr, scale_ptr, bias_ptr, heads_ptr, counts_ptr, y_ptr,
             T, K, N, C,
             sab, sac, sat, sak, swe, swk, swn, ssb, ssc, shb, shc, syb, syt, syn,
             HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # grid (B, cdiv(T, BM), cdiv(N, BN)); a (B, C, T, K), w (E, K, N), y (B, T, N)
    b = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    count = tl.minimum(tl.load(counts_ptr + b), C)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(0, count):  # the example's selected heads, in order: a fixed summation order
        h = tl.load(heads_ptr + b * shb + j * shc)
        part = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            at = tl.load(a_ptr + b * sab + j * sac + offs_m[:, None] * sat + kk[None, :] * sak,
                         mask=(offs_m[:, None] < T) & (kk[None, :] < K), other=0.0)  # (BM, BK)
            wt = tl.load(w_ptr + h * swe + kk[:, None] * swk + offs_n[None, :] * swn,
                         mask=(kk[:, None] < K) & (offs_n[None, :] < N), other=0.0)  # (BK, BN)
            part = tl.dot(at, wt, part, input_precision=PRECISION)
        if HAS_SCALE:
            part = part * tl.load(scale_ptr + b * ssb + j * ssc).to(tl.float32)
        acc += part
    if HAS_BIAS:
        if count > 0:  # a row with no head is exactly zero: no bias either
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + b * syb + offs_m[:, None] * syt + offs_n[None, :] * syn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < N))


@triton.jit
def group_xty(g_ptr, x_ptr, scale_ptr, pairs_ptr, offsets_ptr, dw_ptr, db_ptr,
              T, F, D, C,
              sgb, sgc, sgt, sgf, sxb, sxt, sxd, ssb, ssc, swe, swf, swd, sbe, sbf,
              HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
              BF: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    # grid (E, cdiv(F, BF), cdiv(D, BD)); g (B, C, T, F), x (B, T, D), dw (E, F, D), db (E, F);
    # pairs: flat pair ids b * C + j sorted by head, offsets (E + 1,): head e owns pairs[offsets[e]:offsets[e + 1]]
    e = tl.program_id(0).to(tl.int64)
    offs_f = tl.program_id(1) * BF + tl.arange(0, BF)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    offs_t = tl.arange(0, BT)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BF, BD), dtype=tl.float32)
    acc_b = tl.zeros((BF,), dtype=tl.float32)
    for p in range(start, end):
        pair = tl.load(pairs_ptr + p)
        b = pair // C
        j = pair % C
        part = tl.zeros((BF, BD), dtype=tl.float32)
        part_b = tl.zeros((BF,), dtype=tl.float32)
        for t0 in range(0, T, BT):
            tt = t0 + offs_t
            gt = tl.load(g_ptr + b * sgb + j * sgc + tt[None, :] * sgt + offs_f[:, None] * sgf,
                         mask=(tt[None, :] < T) & (offs_f[:, None] < F), other=0.0)  # (BF, BT)
            xt = tl.load(x_ptr + b * sxb + tt[:, None] * sxt + offs_d[None, :] * sxd,
                         mask=(tt[:, None] < T) & (offs_d[None, :] < D), other=0.0)  # (BT, BD)
            part = tl.dot(gt, xt, part, input_precision=PRECISION)
            if HAS_BIAS:
                part_b += tl.sum(gt.to(tl.float32), axis=1)
        if HAS_SCALE:
            s = tl.load(scale_ptr + b * ssb + j * ssc).to(tl.float32)
            part = part * s
            part_b = part_b * s
        acc += part
        acc_b += part_b
    dw_ptrs = dw_ptr + e * swe + offs_f[:, None] * swf + offs_d[None, :] * swd
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(offs_f[:, None] < F) & (offs_d[None, :] < D))
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            tl.store(db_ptr + e * sbe + offs_f * sbf, acc_b.to(db_ptr.dtype.element_ty), mask=offs_f < F)
