"""Launching the split-K decode kernels of split_k.py: grid, block sizes, strides. Same signature and semantics as
fallback.py (the op picks one of the two modules per call).

One configuration, no autotuning (the interpreter runs none, and a fixed launch is what CUDA graphs replay): the
grid is ``(B * G, cdiv(S, split_n))`` from the shapes alone, then one reduce program per (request, slot) when the
pool takes more than one split. Query rows pad to ``BLOCK_R = max(16, next_pow2(R))`` and the head width to
``BLOCK_D = max(16, next_pow2(Dh))`` (what ``tl.dot`` needs); float32 inputs multiply in IEEE float32.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from condcomp.kv.kernels import split_k


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


def _optional(t: Tensor | None, like: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """A pointer argument and its strides for an optional 2-D tensor (absent: any tensor, zero strides, unread)."""
    return (like, (0, 0)) if t is None else (t, (t.stride(0), t.stride(1)))


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float, kv_index: Tensor | None,
                     group_size: int, bias: Tensor | None, block_n: int, split_n: int) -> Tensor:
    B, G, S, Dh = k.shape
    R = group_size
    out = q.new_empty(B, G * R, 1, Dh)  # (B, G*R, 1, Dh): every element written
    if out.numel() == 0:
        return out
    if S == 0:
        return out.zero_()
    NS = triton.cdiv(S, split_n)
    BLOCK_R, BLOCK_D = _block(R), _block(Dh)
    single = NS == 1
    rows = 0 if single else B * G * NS * BLOCK_R  # the partials: (max, sum) per row, an unnormalised output
    m = torch.empty(rows, device=q.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = torch.empty(rows * BLOCK_D, device=q.device, dtype=torch.float32)
    idx, idx_strides = _optional(kv_index, lengths)
    bias_arg, bias_strides = _optional(bias, q)
    precision = "ieee" if q.dtype == torch.float32 else None
    split_k.partial[(B * G, NS)](
        q, k, v, lengths, idx, bias_arg, out, m, l_sum, acc, G, S, R, Dh, NS, float(scale),
        q.stride(0), q.stride(1), q.stride(3), *k.stride(), *v.stride(), *lengths.stride(), *idx_strides,
        *bias_strides, out.stride(0), out.stride(1), out.stride(3),
        HAS_INDEX=kv_index is not None, HAS_BIAS=bias is not None, SINGLE=single, PRECISION=precision,
        BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, BLOCK_N=block_n, SPLIT_N=split_n)
    if not single:
        split_k.reduce[(B * G,)](lengths, out, m, l_sum, acc, G, S, R, Dh, NS, *lengths.stride(),
                                 out.stride(0), out.stride(1), out.stride(3),
                                 BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, SPLIT_N=split_n)
    return out
