"""The split-K decode attention as a ``torch.library`` custom op (``torch.ops.condcomp.compact_decode_attention``)
with a fake implementation (shapes only: ``torch.compile`` and CUDA graphs capture it), and its public entry point
:func:`compact_decode_attention`, which fills in the tiling from the shapes.

The op runs the Triton kernels (split_k.py, launched by launch.py) where the gathered executor's pair kernels run
(:func:`condcomp.executors.gathered.pairs.kernel_runs`: CUDA in float16/bfloat16/float32, CPU float32 under
``TRITON_INTERPRET=1``), else the torch fallback (fallback.py), with the same semantics. Index values are not
read back to the host on a GPU (that would sync once per layer and step, and a CUDA graph cannot capture it):
``lengths`` past ``S`` are clamped; ``kv_index`` outside the model's groups is refused by name on CPU tensors (the
interpreter's included), where reading it costs no sync, and by a device-side assert elsewhere (``torch._assert_async``:
no host read, captured by CUDA graphs; the error surfaces at the next synchronisation). The compact cache's own calls
skip the check (``check_index=False``): it builds the index in range once per request
(:func:`condcomp.kv.selection.select_kv`).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from condcomp.executors.gathered.pairs import kernel_runs
from condcomp.kv.kernels import fallback

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX = (torch.int32, torch.int64)
TARGET_PROGRAMS = 512  # split the keys until (request, slot, split) programs reach this many (a guess, untimed)


def _impl(t: Tensor) -> ModuleType:
    """The Triton launcher where the kernels run on ``t``, else the torch fallback."""
    if kernel_runs(t):
        from condcomp.kv.kernels import launch

        return launch
    return fallback


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tiling(B: int, G: int, S: int) -> tuple[int, int]:
    """``(block_n, split_n)`` from the shapes alone: 64-key blocks (fewer for a short pool, at least 16), and
    splits of whole blocks, as many as bring the grid to :data:`TARGET_PROGRAMS` programs (one split when ``B * G``
    already does, at most one split per block)."""
    block_n = max(16, min(64, _pow2(S)))
    blocks = max(-(-S // block_n), 1)
    splits = min(max(-(-TARGET_PROGRAMS // max(B * G, 1)), 1), blocks)
    return block_n, -(-blocks // splits) * block_n


def _check(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, kv_index: Tensor | None, group_size: int,
           bias: Tensor | None, block_n: int, split_n: int) -> None:
    op = "compact_decode_attention"
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"{op}: k_pool and v_pool must be (B, G, S, Dh) alike, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    B, G, S, Dh = k.shape
    if q.dim() != 4 or q.shape[0] != B or q.shape[2] != 1 or q.shape[3] != Dh:
        raise ValueError(f"{op}: q must be (B, Hq, 1, Dh) = ({B}, Hq, 1, {Dh}) (one query token per request), got "
                         f"{tuple(q.shape)}")
    if group_size < 1 or (kv_index is None and q.shape[1] != G * group_size) or q.shape[1] % group_size:
        raise ValueError(f"{op}: group_size {group_size} does not fit q's {q.shape[1]} heads and the pool's {G} "
                         "slots (without kv_index q holds the slots' heads in order: Hq = G * group_size)")
    if tuple(lengths.shape) != (B, G) or lengths.dtype not in _INDEX:
        raise ValueError(f"{op}: lengths must be int32 or int64 (B, G) = {(B, G)}, got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if kv_index is not None and (tuple(kv_index.shape) != (B, G) or kv_index.dtype not in _INDEX):
        raise ValueError(f"{op}: kv_index must be int32 or int64 (B, G) = {(B, G)}, got {kv_index.dtype} "
                         f"{tuple(kv_index.shape)}")
    if bias is not None and (tuple(bias.shape) != (B, S) or not bias.is_floating_point()):
        raise ValueError(f"{op}: bias must be floating point (B, S) = {(B, S)}, got {bias.dtype} {tuple(bias.shape)}")
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k_pool and v_pool must share one floating dtype, got {q.dtype}, {k.dtype} and "
                        f"{v.dtype}; cast them")
    others = [t for t in (k, v, lengths, kv_index, bias) if t is not None]
    if any(t.device != q.device for t in others):
        raise ValueError(f"{op}: every tensor must be on q's device {q.device}, got "
                         f"{sorted({str(t.device) for t in others})}")
    if block_n < 16 or block_n & (block_n - 1) or split_n < block_n or split_n % block_n:
        raise ValueError(f"{op}: block_n must be a power of two >= 16 and split_n a multiple of it, got {block_n} "
                         f"and {split_n}")


_INDEX_ADVICE = ("such a slot would be read by another group's or request's query heads. Pass the key/value group "
                 "each slot holds (KVSelection.kv_index from condcomp.kv.selection.select_kv builds it)")


def _check_index_values(q: Tensor, kv_index: Tensor, group_size: int, on_host: bool) -> None:
    """Refuse ``kv_index`` values outside the model's groups ``[0, Hq / group_size)``: by name ``on_host`` (CPU tensors:
    reading the index back is free), else by a device-side assert (no host read: a CUDA graph captures it)."""
    groups = q.shape[1] // group_size
    bad = (kv_index < 0) | (kv_index >= groups)  # (B, G)
    if not on_host:
        torch._assert_async(~bad.any(), f"compact_decode_attention: kv_index holds a value outside the model's "
                            f"{groups} key/value groups [0, {groups}) (q's {q.shape[1]} heads / group_size "
                            f"{group_size}): {_INDEX_ADVICE}")
        return
    if bool(bad.any()):
        where = bad.nonzero().tolist()[:8]
        values = [int(kv_index[b, g]) for b, g in where]
        raise ValueError(f"compact_decode_attention: kv_index holds {values} at (request, slot) {where}, outside the "
                         f"model's {groups} key/value groups [0, {groups}) (q's {q.shape[1]} heads / group_size "
                         f"{group_size}): {_INDEX_ADVICE}")


@torch.library.custom_op("condcomp::compact_decode_attention", mutates_args=())
def decode_attention_op(q: Tensor, k_pool: Tensor, v_pool: Tensor, lengths: Tensor, scale: float,
                        kv_index: Tensor | None, group_size: int, bias: Tensor | None, block_n: int,
                        split_n: int, check_index: bool = True) -> Tensor:
    _check(q, k_pool, v_pool, lengths, kv_index, group_size, bias, block_n, split_n)
    if kv_index is not None and check_index:
        _check_index_values(q, kv_index, group_size, on_host=kv_index.device.type == "cpu")
    return _impl(q).decode_attention(q, k_pool, v_pool, lengths, scale, kv_index, group_size, bias, block_n,
                                      split_n)


@decode_attention_op.register_fake
def _(q: Tensor, k_pool: Tensor, v_pool: Tensor, lengths: Tensor, scale: float, kv_index: Tensor | None,
      group_size: int, bias: Tensor | None, block_n: int, split_n: int, check_index: bool = True) -> Tensor:
    _check(q, k_pool, v_pool, lengths, kv_index, group_size, bias, block_n, split_n)
    B, G, _, Dh = k_pool.shape
    return q.new_empty(B, G * group_size, 1, Dh)


def compact_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, lengths: Tensor, scale: float, *,
                             kv_index: Tensor | None = None, group_size: int | None = None,
                             bias: Tensor | None = None, block_n: int | None = None,
                             split_n: int | None = None, check_index: bool = True) -> Tensor:
    """One decode step's attention over a compact cache's pools, in one launch (two when the keys are split).

    - ``q (B, Hq, 1, Dh)``: one query token per request. ``k_pool``, ``v_pool (B, G, S, Dh)``: each request's
      ``G`` pool slots (its kept key/value groups, as a compact cache layer holds them).
    - ``lengths (B, G)`` int32 (or int64) on the device: slots ``[0, length)`` of each (request, slot) are read, the
      rest never (a full group: the tokens held; a window ring: ``min(held, sinks + window)``; 0: a slot the
      request does not use). Values past ``S`` read ``S``.
    - ``kv_index (B, G)``: the model's key/value group each slot holds (:class:`~condcomp.kv.selection.KVSelection`'s
      ``kv_index``), in ``[0, Hq / group_size)`` (refused outside it: by name on CPU, by a device-side assert
      elsewhere; ``check_index=False`` skips that for an index known in range); slot ``g`` is
      then read by the query heads ``kv_index[b, g] * group_size + j``, ``j < group_size`` (``group_size = Hq /
      the model's key/value heads``, required with ``kv_index``). Without it
      ``q`` holds the slots' heads in order (``Hq = G * group_size``; ``group_size`` defaults to ``Hq / G``).
    - ``bias (B, S)``: an additive term per request and key (padding as ``-inf``), or None.
    - ``block_n``, ``split_n``: keys per block and per split (default :func:`tiling`); they change the launch, not
      the result beyond float rounding.

    Returns ``(B, G * group_size, 1, Dh)`` in ``q``'s dtype, slot ``g``'s heads at rows ``g * group_size + j``;
    a row with no readable key (length 0, or every key's bias ``-inf``) is exactly zero. Accumulation is float32
    (float64 inputs: the torch fallback, in float64).

    >>> import torch
    >>> q, k = torch.ones(1, 2, 1, 4), torch.ones(1, 1, 8, 4)
    >>> v = torch.arange(8.).view(1, 1, 8, 1).expand(1, 1, 8, 4)
    >>> compact_decode_attention(q, k, v, torch.tensor([[3]], dtype=torch.int32), 0.5)[0, :, 0, 0].tolist()
    [1.0, 1.0]
    """
    G = k_pool.shape[1] if k_pool.dim() == 4 else 1
    if group_size is None:
        if kv_index is not None:
            raise ValueError("compact_decode_attention: with kv_index, pass group_size (the model's query heads per "
                             "key/value group): q's heads cannot tell it")
        group_size = q.shape[1] // G if G and q.shape[1] % G == 0 and q.shape[1] >= G else 0
    if block_n is None or split_n is None:
        shape = k_pool.shape if k_pool.dim() == 4 else (1, 1, 1, 1)
        auto_block, auto_split = tiling(int(shape[0]), int(shape[1]), int(shape[2]))
        block_n = auto_block if block_n is None else block_n
        split_n = (-(-auto_split // block_n) * block_n) if split_n is None else split_n
    return torch.ops.condcomp.compact_decode_attention(q, k_pool, v_pool, lengths, float(scale), kv_index,
                                                      int(group_size), bias, int(block_n), int(split_n),
                                                      bool(check_index))
