"""What both kernel launchers share (launch.py: pairs of ``T`` rows; row_launch.py: pairs of one row): pinned block
sizes, the float32 product precision, optional pointer arguments, and the one device sort of the pairs by head."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from condcomp.executors.gathered.pairs import tf32_matmul
from condcomp.executors.gathered.pairs.fallback import active_pairs

ROWS, COLS, REDUCE = 64, 64, 32


def block(n: int, most: int) -> int:
    return max(16, min(most, triton.next_power_of_2(max(n, 1))))


def precision(dtype: torch.dtype) -> str | None:
    """IEEE float32 products unless torch allows TF32; None (the target's default) for half-precision inputs."""
    return "ieee" if dtype == torch.float32 and not tf32_matmul() else None


def optional(t: Tensor | None, like: Tensor, dims: int) -> tuple[Tensor, tuple[int, ...]]:
    """A pointer argument and its strides for an optional tensor (absent: any tensor, zero strides, never read)."""
    return (like, (0,) * dims) if t is None else (t, t.stride())


def sorted_pairs(heads: Tensor, counts: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """Flat pair ids ``b * C + j`` of the selected pairs sorted by head (stable: a fixed order, so deterministic
    sums), then the unselected ones; and ``offsets (E + 1,)``: head ``e`` owns ``pairs[offsets[e]:offsets[e + 1]]``.
    Fixed shapes, on the device: no host read."""
    key = torch.where(active_pairs(heads, counts), heads, num_heads).reshape(-1)  # (B*C,) unselected: past the last
    sorted_key, pairs = torch.sort(key, stable=True)
    offsets = torch.searchsorted(sorted_key, torch.arange(num_heads + 1, device=heads.device, dtype=key.dtype))
    return pairs, offsets


def weight_grads(g: Tensor, num_heads: int, F: int, D: int, with_bias: bool, out_dtype: torch.dtype,
                 dw_out: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The weight-gradient buffers a ``group_xty`` launch fills: ``dw (E, F, D)`` (``dw_out`` when given) and ``db
    (E, F)`` or None, every element written by the kernel."""
    dw = g.new_empty(num_heads, F, D, dtype=out_dtype) if dw_out is None else dw_out
    db = g.new_empty(num_heads, F, dtype=out_dtype) if with_bias else None
    return dw, db
