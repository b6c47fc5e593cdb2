"""Launching the Triton kernels of kernels.py: grids, pinned block sizes, strides, and the one sort of the weight
gradient. Same signatures and semantics as fallback.py (the ops pick one of the two modules per call). Calls with one
row per pair (``T == 1``: token plans) go to row_launch.py (sorted blocks of pairs, ScatterMoE's pattern).

One configuration per kernel, no autotuning (the interpreter runs none, and a fixed launch is what CUDA graphs
replay): 64-wide tiles along rows and outputs, 32 along the reduction, each shrunk to the next power of two of a
small dimension (at least 16, what ``tl.dot`` needs). float32 inputs multiply in IEEE float32 unless torch allows
TF32 matmuls (``torch.backends.cuda.matmul.fp32_precision = "tf32"``, or the legacy ``allow_tf32``), as torch's own
matmul does.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from condcomp.executors.gathered.pairs import kernels
from condcomp.executors.gathered.pairs.tiles import (
    COLS,
    REDUCE,
    ROWS,
    block,
    optional,
    precision,
    sorted_pairs,
    weight_grads,
)


def pair_matmul(x: Tensor, w: Tensor, bias: Tensor | None, scale: Tensor | None, heads: Tensor, counts: Tensor,
                out_dtype: torch.dtype) -> Tensor:
    B, T, D = x.shape
    if T == 1:  # one row per pair (token plans): sorted blocks of pairs
        from condcomp.executors.gathered.pairs import row_launch

        return row_launch.pair_matmul(x, w, bias, scale, heads, counts, out_dtype)
    F, C = w.shape[1], heads.shape[1]
    out = x.new_empty(B, C, T, F, dtype=out_dtype)  # (B, C, T, F): every element written, zeros off the plan
    if out.numel() == 0:
        return out
    BM, BN, BK = block(T, ROWS), block(F, COLS), block(D, REDUCE)
    b_arg, b_strides = optional(bias, x, 2)
    s_arg, s_strides = optional(scale, x, 2)
    grid = (B * C, triton.cdiv(T, BM), triton.cdiv(F, BN))
    kernels.pair_matmul[grid](x, w, b_arg, s_arg, heads, counts.contiguous(), out, T, F, D, C,
                              *x.stride(), *w.stride(), *b_strides, *s_strides, *heads.stride(), *out.stride(),
                              HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, PRECISION=precision(x.dtype),
                              BM=BM, BN=BN, BK=BK)
    return out


def pair_sum(a: Tensor, w: Tensor, scale: Tensor | None, bias: Tensor | None, heads: Tensor, counts: Tensor,
             out_dtype: torch.dtype) -> Tensor:
    B, C, T, K = a.shape
    if T == 1:
        from condcomp.executors.gathered.pairs import row_launch

        return row_launch.pair_sum(a, w, scale, bias, heads, counts, out_dtype)
    N = w.shape[2]
    y = a.new_empty(B, T, N, dtype=out_dtype)  # (B, T, N)
    if y.numel() == 0:
        return y
    BM, BN, BK = block(T, ROWS), block(N, COLS), block(K, REDUCE)
    b_arg, _ = optional(bias, a, 1)
    s_arg, s_strides = optional(scale, a, 2)
    grid = (B, triton.cdiv(T, BM), triton.cdiv(N, BN))
    kernels.pair_sum[grid](a, w, s_arg, b_arg, heads, counts.contiguous(), y, T, K, N, C,
                           *a.stride(), *w.stride(), *s_strides, *heads.stride(), *y.stride(),
                           HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, PRECISION=precision(a.dtype),
                           BM=BM, BN=BN, BK=BK)
    return y


def group_xty(g: Tensor, x: Tensor, scale: Tensor | None, heads: Tensor, counts: Tensor, num_heads: int,
              with_bias: bool, out_dtype: torch.dtype, dw_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    B, C, T, F = g.shape
    if T == 1:
        from condcomp.executors.gathered.pairs import row_launch

        return row_launch.group_xty(g, x, scale, heads, counts, num_heads, with_bias, out_dtype, dw_out)
    D = x.shape[2]
    dw, db = weight_grads(g, num_heads, F, D, with_bias, out_dtype, dw_out)  # (E, F, D), (E, F) | None
    if dw.numel() == 0:
        return dw, None if db is None else db.zero_()
    pairs, offsets = sorted_pairs(heads, counts, num_heads)
    BF, BD, BT = block(F, COLS), block(D, COLS), block(T, REDUCE)
    db_arg, db_strides = optional(db, g, 2)
    s_arg, s_strides = optional(scale, g, 2)
    grid = (num_heads, triton.cdiv(F, BF), triton.cdiv(D, BD))
    kernels.group_xty[grid](g, x, s_arg, pairs, offsets, dw, db_arg, T, F, D, C,
                            *g.stride(), *x.stride(), *s_strides, *dw.stride(), *db_strides,
                            HAS_BIAS=with_bias, HAS_SCALE=scale is not None, PRECISION=precision(g.dtype),
                            BF=BF, BD=BD, BT=BT)
    return dw, db
