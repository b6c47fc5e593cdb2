"""Triton kernels of the pair ops for one row per pair (``T == 1``: token plans, each token an "example" with its
``C`` head slots); imported only when one launches (it imports triton).

ScatterMoE's pattern (``scatter2scatter`` / ``groupXtY``): the selected pairs are sorted by head once on the device;
the forward grid is a fixed number of blocks, ``cdiv(B*C, BM) + E`` (a bound on the blocks the heads' segments need
whatever their lengths), each block ``BM`` sorted pairs of one head, so a tile of that head's weights serves ``BM``
rows; blocks past the last segment exit. Rows and weights are read in place through their strides. No atomics:
every sum has a fixed order, so results are deterministic.

- :func:`rows_matmul`: ``out[b, j] = scale[b, j] * (a[b, j] @ w[h]^T + bias[h])`` for each selected pair
  (``h = heads[b, j]``; ``a[b, j]`` is ``x[b]`` for a projection, whose ``C`` stride is 0); ``out`` is zero elsewhere
  (the launcher zero-fills it).
- :func:`rows_xty`: ``dw[e] = sum over head e's pairs of scale * g[b, j]^T @ x[b]`` and ``db[e]``: one program per
  head tile, its pairs in chunks of ``BT`` sorted rows.
- :func:`row_attention`: each selected (token, routed head) pair's query row attends its example's keys of that
  head: pairs sorted by (example, head), one program per ``BM`` sorted rows of one (example, head), a running
  softmax over blocks of ``BN`` keys (FlashAttention's), causal flag and additive mask applied per row; it also
  writes each row's log-sum-exp for the backward.
- :func:`row_attention_dq` and :func:`row_attention_dkdv`: its backward (FlashAttention-2's), the probabilities
  recomputed from the log-sum-exp: ``dq`` on the forward's grid; ``dk``/``dv`` one program per (example, KV head,
  block of ``BN`` keys), walking the sorted rows of the routed query heads of that KV head's group (GQA) in chunks
  of ``BM``, the sums in registers: no atomics, deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rows_matmul(a_ptr, w_ptr, bias_ptr, scale_ptr, pairs_ptr, block_head_ptr, block_start_ptr, offsets_ptr, out_ptr,
                F, D, C, E,
                sab, sac, sad, swe, swf, swd, sbe, sbf, ssb, ssc, sob, soc, sof,
                HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # grid (NB, cdiv(F, BN)); a (B, C|1, D) as strides, w (E, F, D), out (B, C, F); pairs sorted by head
    h = tl.load(block_head_ptr + tl.program_id(0)).to(tl.int64)
    if h < E:
        start = tl.load(block_start_ptr + tl.program_id(0))
        end = tl.load(offsets_ptr + h + 1)
        offs_p = start + tl.arange(0, BM)
        valid = offs_p < end
        pair = tl.load(pairs_ptr + offs_p, mask=valid, other=0).to(tl.int64)
        b = pair // C
        j = pair % C
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, D, BK):
            kk = k0 + offs_k
            at = tl.load(a_ptr + b[:, None] * sab + j[:, None] * sac + kk[None, :] * sad,
                         mask=valid[:, None] & (kk[None, :] < D), other=0.0)  # (BM, BK)
            wt = tl.load(w_ptr + h * swe + offs_n[None, :] * swf + kk[:, None] * swd,
                         mask=(offs_n[None, :] < F) & (kk[:, None] < D), other=0.0)  # (BK, BN)
            acc = tl.dot(at, wt, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + h * sbe + offs_n * sbf, mask=offs_n < F, other=0.0).to(tl.float32)[None, :]
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + b * ssb + j * ssc, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + b[:, None] * sob + j[:, None] * soc + offs_n[None, :] * sof,
                 acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < F))


@triton.jit
def rows_xty(g_ptr, x_ptr, scale_ptr, pairs_ptr, offsets_ptr, dw_ptr, db_ptr,
             F, D, C,
             sgb, sgc, sgf, sxb, sxd, ssb, ssc, swe, swf, swd, sbe, sbf,
             HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
             BF: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    # grid (E, cdiv(F, BF), cdiv(D, BD)); g (B, C, F), x (B, D) as strides, dw (E, F, D), db (E, F)
    e = tl.program_id(0).to(tl.int64)
    offs_f = tl.program_id(1) * BF + tl.arange(0, BF)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BF, BD), dtype=tl.float32)
    acc_b = tl.zeros((BF,), dtype=tl.float32)
    for p0 in range(start, end, BT):  # the head's pairs in sorted order: a fixed summation order
        offs_p = p0 + tl.arange(0, BT)
        valid = offs_p < end
        pair = tl.load(pairs_ptr + offs_p, mask=valid, other=0).to(tl.int64)
        b = pair // C
        j = pair % C
        gt = tl.load(g_ptr + b[None, :] * sgb + j[None, :] * sgc + offs_f[:, None] * sgf,
                     mask=valid[None, :] & (offs_f[:, None] < F), other=0.0)  # (BF, BT)
        if HAS_SCALE:
            s = tl.load(scale_ptr + b * ssb + j * ssc, mask=valid, other=0.0).to(tl.float32)
            gt = (gt.to(tl.float32) * s[None, :]).to(gt.dtype)
        xt = tl.load(x_ptr + b[:, None] * sxb + offs_d[None, :] * sxd,
                     mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)  # (BT, BD)
        acc = tl.dot(gt, xt, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc_b += tl.sum(gt.to(tl.float32), axis=1)
    tl.store(dw_ptr + e * swe + offs_f[:, None] * swf + offs_d[None, :] * swd, acc.to(dw_ptr.dtype.element_ty),
             mask=(offs_f[:, None] < F) & (offs_d[None, :] < D))
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            tl.store(db_ptr + e * sbe + offs_f * sbf, acc_b.to(db_ptr.dtype.element_ty), mask=offs_f < F)


@triton.jit
def _scores(q, kt, b, h, t, offs_s, valid, mask_ptr, S, scale, smb, smh, smt, sms,
            HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # (BM, BN) scaled scores of rows q (BM, BD) against keys kt (BD, BN), -inf where a key is not allowed; h, t per
    # row (BM,) or scalar
    sc = tl.dot(q, kt, input_precision=PRECISION) * scale
    allowed = valid[:, None] & (offs_s[None, :] < S)
    if IS_CAUSAL:
        allowed = allowed & (offs_s[None, :] <= t[:, None])
    if HAS_MASK:
        sc += tl.load(mask_ptr + b * smb + h * smh + t[:, None] * smt + offs_s[None, :] * sms,
                      mask=allowed, other=0.0).to(tl.float32)
    return tl.where(allowed, sc, float("-inf"))


@triton.jit
def _row_block(seg, block_start_ptr, offsets_ptr, rows_ptr, T, R, E, FIRST, G, BM: tl.constexpr):
    # this program's block of sorted rows in segment seg = b * E + routed head: (b, query head h, its KV head,
    # valid (BM,), pair ids row (BM,), their tokens t (BM,))
    b = seg // E
    h = FIRST + seg % E
    kvh = h // G
    start = tl.load(block_start_ptr + tl.program_id(0))
    end = tl.load(offsets_ptr + seg + 1)
    offs_p = start + tl.arange(0, BM)
    valid = offs_p < end
    row = tl.load(rows_ptr + offs_p, mask=valid, other=0).to(tl.int64)
    t = (row // R) % T
    return b, h, kvh, valid, row, t


@triton.jit
def row_attention(q_ptr, k_ptr, v_ptr, mask_ptr, rows_ptr, block_seg_ptr, block_start_ptr, offsets_ptr, out_ptr,
                  lse_ptr, T, S, Dh, R, E, FIRST, G, NSEG, scale,
                  sqn, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smh, smt, sms, son, sod,
                  HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    # grid (NB,); rows: pair ids n = (b*T + t)*R + r sorted by (example, routed head) segment; q, out (N, Dh);
    # keys, values (B, Hkv, S, Dh); mask additive (B, H, T, S) as strides (0 where broadcast)
    seg = tl.load(block_seg_ptr + tl.program_id(0)).to(tl.int64)
    if seg < NSEG:
        b, h, kvh, valid, row, t = _row_block(seg, block_start_ptr, offsets_ptr, rows_ptr, T, R, E, FIRST, G, BM)
        offs_d = tl.arange(0, BD)
        q = tl.load(q_ptr + row[:, None] * sqn + offs_d[None, :] * sqd,
                    mask=valid[:, None] & (offs_d[None, :] < Dh), other=0.0)  # (BM, BD)
        m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        for s0 in range(0, S, BN):
            offs_s = s0 + tl.arange(0, BN)
            kt = tl.load(k_ptr + b * skb + kvh * skh + offs_s[None, :] * sks + offs_d[:, None] * skd,
                         mask=(offs_s[None, :] < S) & (offs_d[:, None] < Dh), other=0.0)  # (BD, BN)
            sc = _scores(q, kt, b, h, t, offs_s, valid, mask_ptr, S, scale, smb, smh, smt, sms,
                         HAS_MASK, IS_CAUSAL, PRECISION)  # (BM, BN)
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(sc - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_ptr + b * svb + kvh * svh + offs_s[:, None] * svs + offs_d[None, :] * svd,
                         mask=(offs_s[:, None] < S) & (offs_d[None, :] < Dh), other=0.0)  # (BN, BD)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no allowed key: zeros
        tl.store(out_ptr + row[:, None] * son + offs_d[None, :] * sod, o.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (offs_d[None, :] < Dh))
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("inf"))  # no key: exp(s - lse) = 0
        tl.store(lse_ptr + row, lse, mask=valid)


@triton.jit
def row_attention_dq(q_ptr, k_ptr, v_ptr, mask_ptr, rows_ptr, block_seg_ptr, block_start_ptr, offsets_ptr, do_ptr,
                     lse_ptr, delta_ptr, dq_ptr, T, S, Dh, R, E, FIRST, G, NSEG, scale,
                     sqn, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smh, smt, sms, son, sod,
                     HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    # the forward's grid and blocks; do, dq (N, Dh) with out's strides; lse, delta (N,): probabilities recomputed as
    # exp(score - lse), dq = scale * sum over keys of p * (do . v - delta) * k
    seg = tl.load(block_seg_ptr + tl.program_id(0)).to(tl.int64)
    if seg < NSEG:
        b, h, kvh, valid, row, t = _row_block(seg, block_start_ptr, offsets_ptr, rows_ptr, T, R, E, FIRST, G, BM)
        offs_d = tl.arange(0, BD)
        rd_mask = valid[:, None] & (offs_d[None, :] < Dh)
        q = tl.load(q_ptr + row[:, None] * sqn + offs_d[None, :] * sqd, mask=rd_mask, other=0.0)  # (BM, BD)
        do = tl.load(do_ptr + row[:, None] * son + offs_d[None, :] * sod, mask=rd_mask, other=0.0)  # (BM, BD)
        lse = tl.load(lse_ptr + row, mask=valid, other=float("inf"))
        delta = tl.load(delta_ptr + row, mask=valid, other=0.0)
        dq = tl.zeros((BM, BD), dtype=tl.float32)
        for s0 in range(0, S, BN):
            offs_s = s0 + tl.arange(0, BN)
            kv_mask = (offs_s[None, :] < S) & (offs_d[:, None] < Dh)
            kt = tl.load(k_ptr + b * skb + kvh * skh + offs_s[None, :] * sks + offs_d[:, None] * skd,
                         mask=kv_mask, other=0.0)  # (BD, BN)
            vt = tl.load(v_ptr + b * svb + kvh * svh + offs_s[None, :] * svs + offs_d[:, None] * svd,
                         mask=kv_mask, other=0.0)  # (BD, BN)
            sc = _scores(q, kt, b, h, t, offs_s, valid, mask_ptr, S, scale, smb, smh, smt, sms,
                         HAS_MASK, IS_CAUSAL, PRECISION)
            p = tl.exp(sc - lse[:, None])  # (BM, BN)
            ds = p * (tl.dot(do, vt, input_precision=PRECISION) - delta[:, None])
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=PRECISION)
        tl.store(dq_ptr + row[:, None] * son + offs_d[None, :] * sod, (dq * scale).to(dq_ptr.dtype.element_ty),
                 mask=rd_mask)


@triton.jit
def row_attention_dkdv(q_ptr, k_ptr, v_ptr, mask_ptr, rows_ptr, row_seg_ptr, offsets_ptr, do_ptr, lse_ptr, delta_ptr,
                       dk_ptr, dv_ptr, T, S, Dh, R, E, FIRST, G, HKV, scale,
                       sqn, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smh, smt, sms, son, sod,
                       sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd,
                       HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    # grid (B*HKV, cdiv(S, BN)): one (example, KV head, key block) per program; its group's routed heads' sorted rows
    # (one contiguous range: the segments of heads kvh*G .. kvh*G + G - 1 of example b) in chunks of BM, the sums in
    # registers in that fixed order (no atomics); row_seg (N,): each sorted row's segment b*E + slot
    b = (tl.program_id(0) // HKV).to(tl.int64)
    kvh = (tl.program_id(0) % HKV).to(tl.int64)
    offs_s = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    kv_mask = (offs_s[:, None] < S) & (offs_d[None, :] < Dh)
    k = tl.load(k_ptr + b * skb + kvh * skh + offs_s[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + b * svb + kvh * svh + offs_s[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros((BN, BD), dtype=tl.float32)
    dv = tl.zeros((BN, BD), dtype=tl.float32)
    lo = tl.minimum(tl.maximum(kvh * G - FIRST, 0), E)  # the group's routed heads, as slots lo .. hi - 1
    hi = tl.minimum(tl.maximum(kvh * G + G - FIRST, 0), E)
    start = tl.load(offsets_ptr + b * E + lo)
    end = tl.load(offsets_ptr + b * E + hi)
    for p0 in range(start, end, BM):
        offs_p = p0 + tl.arange(0, BM)
        valid = offs_p < end
        row = tl.load(rows_ptr + offs_p, mask=valid, other=0).to(tl.int64)
        h = FIRST + tl.load(row_seg_ptr + offs_p, mask=valid, other=0) % E
        t = (row // R) % T
        rd_mask = valid[:, None] & (offs_d[None, :] < Dh)
        q = tl.load(q_ptr + row[:, None] * sqn + offs_d[None, :] * sqd, mask=rd_mask, other=0.0)  # (BM, BD)
        do = tl.load(do_ptr + row[:, None] * son + offs_d[None, :] * sod, mask=rd_mask, other=0.0)  # (BM, BD)
        lse = tl.load(lse_ptr + row, mask=valid, other=float("inf"))
        delta = tl.load(delta_ptr + row, mask=valid, other=0.0)
        sc = _scores(q, tl.trans(k), b, h[:, None], t, offs_s, valid, mask_ptr, S, scale, smb, smh, smt, sms,
                     HAS_MASK, IS_CAUSAL, PRECISION)
        p = tl.exp(sc - lse[:, None])  # (BM, BN)
        dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=PRECISION)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PRECISION)
    tl.store(dk_ptr + b * sdkb + kvh * sdkh + offs_s[:, None] * sdks + offs_d[None, :] * sdkd,
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + b * sdvb + kvh * sdvh + offs_s[:, None] * sdvs + offs_d[None, :] * sdvd,
             dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)
