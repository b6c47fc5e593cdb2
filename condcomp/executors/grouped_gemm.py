"""Grouped GEMMs over pointer lists on CPU: MKL's ``cblas_?gemm_batch``, as linked into PyTorch's CPU library.

Each GEMM of a batch reads its operands in place, at its own offset in a tensor (an example's input rows, a head's
weight block, one (example, head) pair's output), so the gathered executor multiplies the selected (example, head)
pairs without copying input rows or weight slices first: those copies are what separates the bucketed batched
matmuls from a k-head block of the same heads (timed per step with ``condcomp bench attention``).
PyTorch exposes no CPU grouped GEMM that takes pointers (``torch._grouped_mm`` has no CPU backward in 2.13), but
its x86 wheels link MKL statically and export the CBLAS symbols; this module calls them with ``ctypes``.

Used only where it is safe to: CPU tensors, float32 or float64, and a library that exports the symbol and passes
a self-test against ``torch.mm`` (:func:`available`; the self-test runs at the first call that asks, never at
``import condcomp``, and not at all while ``ENABLED`` is False). Anywhere else the executor keeps its
batched-matmul strategies.

Two differentiable ops are built on it (``torch.autograd.Function``; their backward passes are grouped GEMMs too):

- :func:`pair_projection`: ``out[p] = x[b_p] @ w[h_p]^T (+ bias[h_p])`` for every pair ``p = (b_p, h_p)``;
- :func:`pair_output`: ``y[b] = base[b] + sum over the pairs p of b of o[p] @ w_o[:, h_p block]^T``.

Every call site passes host-known sizes; on CPU reading a count back costs no synchronisation.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch
from torch import Tensor

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enum values
_SYMBOLS = {torch.float32: ("cblas_sgemm_batch", ctypes.c_float), torch.float64: ("cblas_dgemm_batch", ctypes.c_double)}
_INT = ctypes.c_int  # MKL_INT of the LP64 interface PyTorch links (checked by the self-test)

# Set to False to keep the gathered executor on its batched-matmul strategies everywhere (and skip the self-test).
# Tests do not flip it: they choose a strategy by name or pass a GatheredTuning(grouped_gemm=False).
ENABLED = True


@functools.cache
def _gemm_batch_symbol(dtype: torch.dtype) -> Any:
    """The ``cblas_?gemm_batch`` function of PyTorch's CPU library, or None where it does not export one."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = getattr(lib, _SYMBOLS[dtype][0])
    except (OSError, AttributeError, KeyError):  # no such library (Windows, macOS) or a build without MKL
        return None
    fn.restype = None
    return fn


@functools.cache
def _passes_self_test(dtype: torch.dtype) -> bool:
    """Two small GEMMs of each transpose kind through the batch call, against ``torch.mm`` (guards the ABI)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 5, generator=gen, dtype=dtype), torch.randn(2, 5, 4, generator=gen, dtype=dtype)
    c = torch.randn(2, 3, 4, generator=gen, dtype=dtype)
    expect = c + a @ b
    offsets = torch.tensor([0, 1])
    try:
        gemm_batch(a, offsets * 15, 5, False, b, offsets * 20, 4, False, c, offsets * 12, 4, 3, 4, 5, beta=1.0)
        ct = torch.zeros(2, 4, 3, dtype=dtype)  # (a @ b)^T = b^T @ a^T, both operands read transposed
        gemm_batch(b, offsets * 20, 4, True, a, offsets * 15, 5, True, ct, offsets * 12, 3, 4, 3, 5, beta=0.0)
    except (OSError, ctypes.ArgumentError):
        return False
    return torch.allclose(c, expect) and torch.allclose(ct.transpose(1, 2), a @ b)


def _detect(symbol: Any = None, self_test: Any = None) -> frozenset[torch.dtype]:
    """The dtypes whose batch GEMM this torch exports and passes the self-test (``symbol`` and ``self_test``
    replace the real lookups in tests: a build without MKL, a failing ABI check)."""
    symbol, self_test = symbol or _gemm_batch_symbol, self_test or _passes_self_test
    return frozenset(d for d in _SYMBOLS if symbol(d) is not None and self_test(d))


_READY: frozenset[torch.dtype] | None = None  # set by the first call of available() (detection runs once)


@torch.compiler.disable  # loads a library and runs GEMMs through ctypes: runs eagerly, once
def _detect_once() -> frozenset[torch.dtype]:
    global _READY
    if _READY is None:
        _READY = _detect()
    return _READY


def unavailable_reason(t: Tensor) -> str | None:
    """Why grouped GEMMs cannot run on ``t``'s device and dtype here, or None when they can (CPU,
    float32/float64, MKL's batch GEMM exported and passing its self-test, ``ENABLED``)."""
    if not ENABLED:
        return "grouped_gemm.ENABLED is False"
    if t.device.type != "cpu" or t.dtype not in _SYMBOLS:
        return f"grouped GEMMs run on CPU in float32/float64, not {t.device.type} {t.dtype}"
    ready = _READY if _READY is not None else _detect_once()  # after the first call: a plain lookup (traceable)
    if t.dtype not in ready:
        return f"this torch build has no working MKL cblas batch GEMM for {t.dtype}"
    return None


def available(t: Tensor) -> bool:
    """Whether grouped GEMMs can run on ``t``'s device and dtype here (CPU, float32/float64, MKL present)."""
    return unavailable_reason(t) is None


def gemm_batch(
    a: Tensor, a_off: Tensor, lda: int, trans_a: bool,
    b: Tensor, b_off: Tensor, ldb: int, trans_b: bool,
    c: Tensor, c_off: Tensor, ldc: int,
    m: int, n: int, k: int, beta: float = 0.0, chunks: list[int] | None = None,
) -> None:
    """For every i: ``C_i = op(A_i) @ op(B_i) + beta * C_i`` with ``op(A_i)`` (m, k), ``op(B_i)`` (k, n) and
    ``C_i`` (m, n), row-major. ``X_i`` starts at element ``x_off[i]`` of contiguous tensor ``x`` and its rows are
    ``ldx`` elements apart. The GEMMs of one batch call run in parallel, so their ``C_i`` must not overlap;
    ``chunks`` splits the GEMMs, in order, into consecutive batch calls of these sizes (GEMMs adding into the same
    C go into different chunks; see :func:`rounds`). Default: one call.

    Offsets are int64 tensors; the caller guarantees every matrix lies inside its tensor (not checked per GEMM,
    which would cost a host loop)."""
    count = a_off.numel()
    if count == 0:
        return
    fn = _gemm_batch_symbol(c.dtype)
    scalar = _SYMBOLS[c.dtype][1]
    size = c.element_size()
    # pointer arrays: one int64 address per GEMM, read by MKL as `const float **`; a chunk is a slice of them
    ptrs = [(t.data_ptr() + off * size).contiguous() for t, off in ((a, a_off), (b, b_off), (c, c_off))]
    start = 0
    for n_gemms in chunks if chunks is not None else [count]:
        pa, pb, pc = (ctypes.c_void_p(p.data_ptr() + start * 8) for p in ptrs)
        fn(_INT(_ROW_MAJOR), ctypes.byref(_INT(_TRANS if trans_a else _NO_TRANS)),
           ctypes.byref(_INT(_TRANS if trans_b else _NO_TRANS)), ctypes.byref(_INT(m)), ctypes.byref(_INT(n)),
           ctypes.byref(_INT(k)), ctypes.byref(scalar(1.0)), pa, ctypes.byref(_INT(lda)), pb,
           ctypes.byref(_INT(ldb)), ctypes.byref(scalar(beta)), pc, ctypes.byref(_INT(ldc)), _INT(1),
           ctypes.byref(_INT(n_gemms)))
        start += n_gemms


def rounds(keys: Tensor) -> tuple[Tensor, list[int]]:
    """Positions of ``keys (P,)`` ordered round by round, and each round's size: round r holds the r-th occurrence
    of every key that has one (in key order), so no key repeats within a round. GEMMs that add into the matrix a
    key names run one batch call per round (``gemm_batch(..., chunks=sizes)``)."""
    if not keys.numel():
        return keys, []
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys.index_select(0, order)
    counts = torch.bincount(sorted_keys)
    rank = torch.arange(keys.numel(), device=keys.device) - (torch.cumsum(counts, 0) - counts).index_select(
        0, sorted_keys)  # rank of order[i] among its key's occurrences
    return order.index_select(0, torch.argsort(rank, stable=True)), torch.bincount(rank).tolist()


class _PairProjection(torch.autograd.Function):
    """``out (P, T, N)``: ``out[p] = x[b_p] @ w[h_p]^T + bias[h_p]``; x ``(B, T, D)``, w ``(H, N, D)``, bias
    ``(H, N)`` or None."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, bias: Tensor | None, b_idx: Tensor, h_idx: Tensor) -> Tensor:
        _, T, D = x.shape
        N, P = w.shape[1], b_idx.numel()
        if bias is None:
            out = x.new_empty(P, T, N)
        else:  # the bias first, then the products added onto it (beta = 1), as torch.addmm does
            out = bias.index_select(0, h_idx).unsqueeze(1).expand(P, T, N).contiguous()
        pair = torch.arange(P, device=x.device)
        gemm_batch(x, b_idx * (T * D), D, False, w, h_idx * (N * D), D, True, out, pair * (T * N), N, T, N, D,
                   beta=0.0 if bias is None else 1.0)
        ctx.save_for_backward(x, w, b_idx, h_idx)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        x, w, b_idx, h_idx = ctx.saved_tensors
        (_, T, D), (H, N, _), P = x.shape, w.shape, b_idx.numel()
        d_out = d_out.contiguous()  # (P, T, N)
        pair = torch.arange(P, device=x.device)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx[b] += d_out[p] @ w[h_p], one call per head slot of the examples
            dx = torch.zeros_like(x)
            order, sizes = rounds(b_idx)
            gemm_batch(d_out, order * (T * N), N, False, w, h_idx.index_select(0, order) * (N * D), D, False,
                       dx, b_idx.index_select(0, order) * (T * D), D, T, D, N, beta=1.0, chunks=sizes)
        if ctx.needs_input_grad[1]:  # dw[h] = sum over the pairs p of head h of d_out[p]^T @ x[b_p]
            # Each pair's product into its own block, then a sum per head. Adding into dw in place needs one call
            # per rank of a pair within its head (GEMMs of one call must not write the same block), which was
            # slower at every shape of the attention benchmark.
            per_pair = x.new_empty(P, N, D)
            gemm_batch(d_out, pair * (T * N), N, True, x, b_idx * (T * D), D, False, per_pair, pair * (N * D), D,
                       N, D, T)
            dw = torch.zeros_like(w).index_add_(0, h_idx, per_pair)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = d_out.new_zeros(H, N).index_add_(0, h_idx, d_out.sum(1))
        return dx, dw, db, None, None


class _PairOutput(torch.autograd.Function):
    """``y (B, T, D)``: ``y[b] = base[b] + sum over pairs p of b of o[p] @ w_o[:, h_p*Dh:(h_p+1)*Dh]^T``; o
    ``(P, T, Dh)``, w_o ``(D, H*Dh)`` (the output projection as stored), base ``(B, T, D)``."""

    @staticmethod
    def forward(ctx: Any, o: Tensor, w_o: Tensor, base: Tensor, b_idx: Tensor, h_idx: Tensor) -> Tensor:
        P, T, Dh = o.shape
        D, HDh = w_o.shape
        y = torch.empty(base.shape, dtype=o.dtype, device=o.device)
        y.copy_(base)  # a fresh tensor whatever base is (an expanded bias, a contiguous tensor)
        order, sizes = rounds(b_idx)  # one call per head slot: no two GEMMs of a call add into the same example
        gemm_batch(o, order * (T * Dh), Dh, False, w_o, h_idx.index_select(0, order) * Dh, HDh, True,
                   y, b_idx.index_select(0, order) * (T * D), D, T, D, Dh, beta=1.0, chunks=sizes)
        ctx.save_for_backward(o, w_o, b_idx, h_idx)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        o, w_o, b_idx, h_idx = ctx.saved_tensors
        (P, T, Dh), (D, HDh) = o.shape, w_o.shape
        dy = dy.contiguous()  # (B, T, D)
        pair = torch.arange(P, device=o.device)
        do = dw_o = None
        if ctx.needs_input_grad[0]:  # do[p] = dy[b_p] @ w_o[:, h_p block]
            do = o.new_empty(P, T, Dh)
            gemm_batch(dy, b_idx * (T * D), D, False, w_o, h_idx * Dh, HDh, False, do, pair * (T * Dh), Dh,
                       T, Dh, D)
        if ctx.needs_input_grad[1]:  # dw_o[:, h block] = sum over the pairs p of head h of dy[b_p]^T @ o[p]
            per_pair = o.new_empty(P, D, Dh)  # as for dw in _PairProjection: per pair, then a sum per head
            gemm_batch(dy, b_idx * (T * D), D, True, o, pair * (T * Dh), Dh, False, per_pair, pair * (D * Dh), Dh,
                       D, Dh, T)
            dw_o = o.new_zeros(HDh // Dh, D, Dh).index_add_(0, h_idx, per_pair).transpose(0, 1).reshape(D, HDh)
        return do, dw_o, dy if ctx.needs_input_grad[2] else None, None, None


def pair_projection(x: Tensor, w: Tensor, bias: Tensor | None, b_idx: Tensor, h_idx: Tensor) -> Tensor:
    """``(P, T, N)``: every pair's ``x[b_p] (T, D)`` times its head's ``w[h_p] (N, D)`` transposed, plus
    ``bias[h_p]``; no input row or weight block is copied. Differentiable in x, w and bias."""
    out: Tensor = _PairProjection.apply(x.contiguous(), w.contiguous(),
                                        None if bias is None else bias.contiguous(), b_idx, h_idx)
    return out


def pair_output(o: Tensor, w_o: Tensor, base: Tensor, b_idx: Tensor, h_idx: Tensor) -> Tensor:
    """``(B, T, D)``: ``base`` plus every pair's ``o[p] (T, Dh)`` projected by its head's columns of the output
    projection ``w_o (D, H*Dh)``, summed into its example. Differentiable in o, w_o and base."""
    y: Tensor = _PairOutput.apply(o.contiguous(), w_o.contiguous(), base, b_idx, h_idx)
    return y
