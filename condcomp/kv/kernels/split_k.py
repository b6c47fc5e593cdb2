"""The two Triton kernels of the split-K decode attention; imported only when a kernel launches (it imports triton).

One program per (request, pool slot, split of the keys): it reads the slot's kept-group index, the query heads of
that group (all ``R`` of them: a group's keys are read once for its query heads, as a ``tl.dot`` of ``BLOCK_R >= 16``
padded rows), and only the key blocks of its split that lie below the slot's length; a split at or past the length
runs no iteration. Scores are float32 (``tl.dot`` accumulates in float32; float32 inputs multiply in IEEE float32),
softmax is online (running max and sum). :func:`partial` writes each split's (max, sum, unnormalised output), or,
with ``SINGLE`` (one split covers the pool), the normalised output itself; :func:`reduce` combines a slot's live
splits. A row with no readable key (length 0, or every key's bias ``-inf``) has sum 0 and outputs zeros. No atomics:
deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def partial(q_ptr, k_ptr, v_ptr, len_ptr, idx_ptr, bias_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
            G, S, R, Dh, NS, scale,
            sqb, sqh, sqd, skb, skg, sks, skd, svb, svg, svs, svd, slb, slg, sib, sig, sbb, sbs, sob, soh, sod,
            HAS_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr):
    # grid (B * G, NS); q (B, Hq, 1, Dh), k/v (B, G, S, Dh), lengths (B, G), kv_index (B, G), bias (B, S),
    # out (B, G * R, 1, Dh); partials m/l (B * G, NS, BLOCK_R), acc (B * G, NS, BLOCK_R, BLOCK_D) float32
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // G
    g = pid % G
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b * slb + g * slg).to(tl.int32), 0), S)
    group = g
    if HAS_INDEX:
        group = tl.load(idx_ptr + b * sib + g * sig).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_r < R
    d_ok = offs_d < Dh
    q = tl.load(q_ptr + b * sqb + (group * R + offs_r)[:, None] * sqh + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_R, BLOCK_D)
    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    start = split * SPLIT_N
    end = tl.minimum(start + SPLIT_N, length)
    k_base = k_ptr + b * skb + g * skg
    v_base = v_ptr + b * svb + g * svg
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        kt = tl.load(k_base + offs_n[None, :] * sks + offs_d[:, None] * skd, mask=n_ok[None, :] & d_ok[:, None],
                     other=0.0)  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale  # (BLOCK_R, BLOCK_N) float32
        if HAS_BIAS:
            s += tl.load(bias_ptr + b * sbb + offs_n * sbs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every score -inf so far: nothing to rescale
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=n_ok[:, None] & d_ok[None, :],
                     other=0.0)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    if SINGLE:
        o = tl.where(l_i[:, None] == 0, 0.0, acc / tl.where(l_i == 0, 1.0, l_i)[:, None])  # NaN stays NaN
        tl.store(out_ptr + b * sob + (g * R + offs_r)[:, None] * soh + offs_d[None, :] * sod,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        if start < length:  # reduce reads only the live splits
            at = (pid * NS + split) * BLOCK_R + offs_r
            tl.store(m_ptr + at, m_i)
            tl.store(l_ptr + at, l_i)
            tl.store(acc_ptr + at[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit
def reduce(len_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
           G, S, R, Dh, NS,
           slb, slg, sob, soh, sod,
           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_N: tl.constexpr):
    # grid (B * G,): combines the live splits (those starting below the slot's length) of partial's outputs
    pid = tl.program_id(0).to(tl.int64)
    b = pid // G
    g = pid % G
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b * slb + g * slg).to(tl.int32), 0), S)
    live = tl.minimum((length + SPLIT_N - 1) // SPLIT_N, NS)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for split in range(0, live):  # in split order: a fixed summation order
        at = (pid * NS + split) * BLOCK_R + offs_r
        m_s = tl.load(m_ptr + at)
        l_s = tl.load(l_ptr + at)
        acc_s = tl.load(acc_ptr + at[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        c = tl.exp(m_s - m_safe)
        l_sum = l_sum * a + l_s * c
        acc = acc * a[:, None] + acc_s * c[:, None]
        m = m_new
    o = tl.where(l_sum[:, None] == 0, 0.0, acc / tl.where(l_sum == 0, 1.0, l_sum)[:, None])  # NaN stays NaN
    tl.store(out_ptr + b * sob + (g * R + offs_r)[:, None] * soh + offs_d[None, :] * sod,
             o.to(out_ptr.dtype.element_ty), mask=(offs_r < R)[:, None] & (offs_d < Dh)[None, :])
