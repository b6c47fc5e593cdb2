"""Launching row_kernels.py: the pair ops' launches when every pair is one row (``T == 1``, token plans). Same
signatures and semantics as launch.py's (which hands such calls here) and fallback.py's.

The selected pairs are sorted by head once per call (:func:`tiles.sorted_pairs`, on the device); the forward grid
is ``cdiv(B*C, BM) + E`` blocks, each ``BM`` sorted pairs of one head (:func:`blocks`), whatever the plan selects.
``pair_sum`` (a row's sum over its ``C`` heads) computes each pair's product in the sorted blocks, then sums the
``C`` products of each row in torch: a fixed order, no atomics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from torch import Tensor

from condcomp.executors.gathered.pairs import row_kernels
from condcomp.executors.gathered.pairs.tiles import COLS, REDUCE, block, optional, precision, sorted_pairs, weight_grads

ROWS = 64  # sorted pairs per block: the rows one weight tile serves


def blocks(offsets: Tensor, pairs: int, rows: int) -> tuple[Tensor, Tensor]:
    """``(head, start)`` of each of the ``cdiv(pairs, rows) + E`` blocks: block ``i`` covers sorted pairs
    ``start[i] .. start[i] + rows - 1`` of head ``head[i]`` (cut at the head's segment end); ``head[i] == E`` past
    the last segment (the block exits). On the device, fixed shapes."""
    E = offsets.shape[0] - 1
    lens = offsets[1:] - offsets[:-1]  # (E,)
    per_head = torch.div(lens + rows - 1, rows, rounding_mode="floor")
    ends = torch.cumsum(per_head, 0)  # (E,) blocks up to and including each head
    index = torch.arange(triton.cdiv(max(pairs, 1), rows) + E, device=offsets.device)
    head = torch.searchsorted(ends, index, right=True)  # (NB,) in [0, E]
    h = head.clamp(max=E - 1)
    start = offsets[h] + (index - (ends - per_head)[h]) * rows
    return head, start


def _launch_rows(a: Tensor, a_strides: tuple[int, int, int], w: Tensor, w_strides: tuple[int, int, int],
                 bias: Tensor | None, scale: Tensor | None, heads: Tensor, counts: Tensor, E: int, F: int, D: int,
                 out: Tensor) -> Tensor:
    """``out (B, C, F)`` (zero-filled) gets ``scale * (a[b, j] @ w[h]^T + bias[h])`` on each selected pair."""
    C = heads.shape[1]
    pairs, offsets = sorted_pairs(heads, counts, E)
    BM, BN, BK = block(heads.numel(), ROWS), block(F, COLS), block(D, REDUCE)
    head, start = blocks(offsets, heads.numel(), BM)
    b_arg, b_strides = optional(bias, a, 2)
    s_arg, s_strides = optional(scale, a, 2)
    grid = (head.shape[0], triton.cdiv(F, BN))
    row_kernels.rows_matmul[grid](a, w, b_arg, s_arg, pairs, head, start, offsets, out, F, D, C, E,
                                  *a_strides, *w_strides, *b_strides, *s_strides, *out.stride(),
                                  HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
                                  PRECISION=precision(a.dtype), BM=BM, BN=BN, BK=BK)
    return out


def pair_matmul(x: Tensor, w: Tensor, bias: Tensor | None, scale: Tensor | None, heads: Tensor, counts: Tensor,
                out_dtype: torch.dtype) -> Tensor:
    B, _, D = x.shape  # (B, 1, D)
    E, F = w.shape[:2]
    out = x.new_zeros(B, heads.shape[1], 1, F, dtype=out_dtype)  # zeros off the plan
    if out.numel() == 0 or x.numel() == 0:
        return out
    ws = w.stride()
    _launch_rows(x, (x.stride(0), 0, x.stride(2)), w, (ws[0], ws[1], ws[2]), bias, scale, heads, counts, E, F, D,
                 out.view(B, heads.shape[1], F))  # x's C stride 0: every head slot of a row reads the same row
    return out


def pair_sum(a: Tensor, w: Tensor, scale: Tensor | None, bias: Tensor | None, heads: Tensor, counts: Tensor,
             out_dtype: torch.dtype) -> Tensor:
    B, C, _, K = a.shape  # (B, C, 1, K), w (E, K, N)
    E, _, N = w.shape
    wide = torch.promote_types(out_dtype, torch.float32)  # the C products summed in float32 at least
    parts = a.new_zeros(B, C, N, dtype=wide)
    if parts.numel() and a.numel():
        ws = w.stride()
        _launch_rows(a, (a.stride(0), a.stride(1), a.stride(3)), w, (ws[0], ws[2], ws[1]), None, scale, heads,
                     counts, E, N, K, parts)  # w[h]^T read through its strides: (N, K)
    y = parts.sum(1, keepdim=True)  # (B, 1, N)
    if bias is not None:
        y = y + bias.to(wide) * (counts > 0).to(wide)[:, None, None]
    return y.to(out_dtype)


def group_xty(g: Tensor, x: Tensor, scale: Tensor | None, heads: Tensor, counts: Tensor, num_heads: int,
              with_bias: bool, out_dtype: torch.dtype, dw_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    _, C, _, F = g.shape  # (B, C, 1, F), x (B, 1, D)
    D = x.shape[2]
    dw, db = weight_grads(g, num_heads, F, D, with_bias, out_dtype, dw_out)  # (E, F, D), (E, F) | None
    if dw.numel() == 0:
        return dw, None if db is None else db.zero_()
    pairs, offsets = sorted_pairs(heads, counts, num_heads)
    BF, BD, BT = block(F, COLS), block(D, COLS), block(heads.numel(), REDUCE)
    db_arg, db_strides = optional(db, g, 2)
    s_arg, s_strides = optional(scale, g, 2)
    grid = (num_heads, triton.cdiv(F, BF), triton.cdiv(D, BD))
    row_kernels.rows_xty[grid](g, x, s_arg, pairs, offsets, dw, db_arg, F, D, C,
                               g.stride(0), g.stride(1), g.stride(3), x.stride(0), x.stride(2), *s_strides,
                               *dw.stride(), *db_strides, HAS_BIAS=with_bias, HAS_SCALE=scale is not None,
                               PRECISION=precision(g.dtype), BF=BF, BD=BD, BT=BT)
    return dw, db


def head_tile(Dh: int) -> int:
    """The row attention's tile over the head dimension: all of it (a row's scores need its whole dot product)."""
    return max(16, triton.next_power_of_2(Dh))


class _Rows(NamedTuple):
    """The row attention's launch plan: pair rows sorted by (example, routed head) segment, once per call."""

    rows: Tensor  # (N,) pair ids (b*T + t)*R + r, the selected ones sorted by segment b*E + slot, then the others
    row_seg: Tensor  # (N,) each sorted row's segment (B*E past the last)
    offsets: Tensor  # (B*E + 1,) segment i owns rows[offsets[i]:offsets[i + 1]]
    mask: Tensor  # the additive mask as (B, H, T, S) strides (q, never read, without one)
    mask_strides: tuple[int, int, int, int]


def _rows(q: Tensor, keys: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor, first: int, E: int) -> _Rows:
    B, T, R, _ = q.shape
    chosen = torch.arange(R, device=q.device) < counts.unsqueeze(-1)  # (B, T, R)
    b = torch.arange(B, device=q.device)[:, None, None]
    key = torch.where(chosen, b * E + slot, B * E).reshape(-1)  # (N,) unselected: past the last segment
    row_seg, rows = torch.sort(key, stable=True)
    offsets = torch.searchsorted(row_seg, torch.arange(B * E + 1, device=q.device, dtype=key.dtype))
    m_arg, m_strides = q, (0, 0, 0, 0)  # absent: never read
    if mask is not None:
        m = mask if mask.is_floating_point() else torch.where(mask, 0.0, float("-inf"))
        m_arg = m.expand(B, first + E, T, keys.shape[2])  # broadcast dimensions: stride 0
        m_strides = (m_arg.stride(0), m_arg.stride(1), m_arg.stride(2), m_arg.stride(3))
    return _Rows(rows, row_seg, offsets, m_arg, m_strides)


def row_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor,
                  first: int, num_routed: int, group: int, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of the selected (token, routed head) pairs only: ``q (B, T, R, Dh)``, pair ``(b, t, r)`` is head
    ``first + slot[b, t, r]`` for ``r < counts[b, t]``; keys/values ``(B, Hkv, S, Dh)``; ``mask`` additive float
    or bool ``(B|1, H|1, T|1, S)``. Pairs sorted by (example, head) once; one block of ``BM`` sorted rows of one
    (example, head) per program, a static grid of ``cdiv(B*T*R, BM) + B*E`` blocks. -> ``(B, T, R, Dh)``, zeros on
    unselected pairs and rows with no allowed key, and each row's log-sum-exp ``(B, T, R)`` float32 (``+inf`` on
    those; what the backward recomputes the probabilities from)."""
    B, T, R, Dh = q.shape
    S, E = keys.shape[2], num_routed
    out = q.new_zeros(B * T * R, Dh)
    lse = q.new_full((B * T * R,), float("inf"), dtype=torch.float32)
    if out.numel() == 0 or S == 0:
        return out.view(B, T, R, Dh), lse.view(B, T, R)
    plan = _rows(q, keys, mask, slot, counts, first, E)
    BM, BN, BD = block(B * T * R, ROWS), block(S, COLS), head_tile(Dh)
    seg, start = blocks(plan.offsets, B * T * R, BM)
    qf = q.reshape(B * T * R, Dh)
    row_kernels.row_attention[(seg.shape[0],)](
        qf, keys, values, plan.mask, plan.rows, seg, start, plan.offsets, out, lse, T, S, Dh, R, E, first, group,
        B * E, scale, *qf.stride(), *keys.stride(), *values.stride(), *plan.mask_strides, *out.stride(),
        HAS_MASK=mask is not None, IS_CAUSAL=is_causal, PRECISION=precision(q.dtype), BM=BM, BN=BN, BD=BD)
    return out.view(B, T, R, Dh), lse.view(B, T, R)


def row_attention_backward(grad: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor,
                           counts: Tensor, out: Tensor, lse: Tensor, first: int, num_routed: int, group: int,
                           is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`row_attention` (FlashAttention-2's backward on the sorted rows, probabilities
    recomputed from ``lse``): ``dq`` per block of sorted rows (the forward's grid), ``dk``/``dv`` one program per
    (example, KV head, key block) over the sorted rows of its group's routed heads, summed in registers in that
    fixed order (no atomics: deterministic). KV heads no routed head reads get zeros."""
    B, T, R, Dh = q.shape
    S, E, Hkv = keys.shape[2], num_routed, keys.shape[1]
    dq = q.new_zeros(B * T * R, Dh)
    dk, dv = keys.new_empty(keys.shape), values.new_empty(values.shape)
    if dq.numel() == 0 or S == 0 or Hkv == 0:
        return dq.view(q.shape), dk.zero_(), dv.zero_()
    plan = _rows(q, keys, mask, slot, counts, first, E)
    qf, do, of = q.reshape(-1, Dh), grad.reshape(-1, Dh).contiguous(), out.reshape(-1, Dh)
    delta = (do.float() * of.float()).sum(-1)  # (N,): each row's do . o
    lse_f = lse.reshape(-1).float()
    BM, BN, BD = block(B * T * R, ROWS), block(S, COLS), head_tile(Dh)
    seg, start = blocks(plan.offsets, B * T * R, BM)
    common = dict(HAS_MASK=mask is not None, IS_CAUSAL=is_causal, PRECISION=precision(q.dtype), BM=BM, BN=BN, BD=BD)
    strides = (*qf.stride(), *keys.stride(), *values.stride(), *plan.mask_strides, *do.stride())
    row_kernels.row_attention_dq[(seg.shape[0],)](
        qf, keys, values, plan.mask, plan.rows, seg, start, plan.offsets, do, lse_f, delta, dq,
        T, S, Dh, R, E, first, group, B * E, scale, *strides, **common)
    row_kernels.row_attention_dkdv[(B * Hkv, triton.cdiv(S, BN))](
        qf, keys, values, plan.mask, plan.rows, plan.row_seg, plan.offsets, do, lse_f, delta, dk, dv,
        T, S, Dh, R, E, first, group, Hkv, scale, *strides, *dk.stride(), *dv.stride(), **common)
    return dq.view(q.shape), dk, dv
