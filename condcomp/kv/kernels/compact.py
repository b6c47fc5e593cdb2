"""A compact cache's decode step through :func:`~condcomp.kv.kernels.compact_decode_attention`: its inputs read from
what the ``kv_cache`` executor holds (the held plan's :class:`~condcomp.kv.selection.KVSelection`, the call's
:class:`~condcomp.masks.AttentionMask`, a static layer's device count of tokens), with no host read."""

from __future__ import annotations

import torch
from torch import Tensor

from condcomp.kv.kernels.ops import compact_decode_attention
from condcomp.kv.selection import KVSelection
from condcomp.masks import AttentionMask, additive_bias


def per_request(bias: Tensor | None) -> bool:
    """Whether an additive bias broadcast to ``(B, H, T, S)`` is the same for every head (what the kernel takes)."""
    return bias is None or bias.dim() < 3 or bias.shape[-3] == 1


def slot_lengths(selection: KVSelection, held: Tensor) -> Tensor:
    """``(B, g)`` int32: ``held`` (a device scalar: the tokens every full slot holds) for the slots a row uses, 0 for
    its spare slots (every query head at gate 0: never read)."""
    B, g = selection.kv_index.shape
    used = selection.slot_gates.view(B, g, -1).ne(0).any(-1)  # (B, g)
    return torch.where(used, held.to(torch.int32), 0).to(torch.int32)


def request_bias(mask: AttentionMask, B: int, S: int) -> Tensor | None:
    """``(B, S)``: the additive term of a decode step's mask ``(B|1, 1, 1, S)`` (one query, the same for every head),
    or None."""
    m = mask.mask
    if m is None:
        return None
    row = m[:, 0, 0, :]  # (B|1, 1, 1, S) -> (B|1, S)
    return (additive_bias(row) if row.dtype == torch.bool else row).expand(B, S)


def compact_decode(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, selection: KVSelection, held: Tensor,
                   group_size: int, scale: float) -> Tensor:
    """Every query head ``q (B, H, 1, Dh)`` over the full slots ``k``, ``v (B, g, S, Dh)`` that hold ``held`` tokens:
    ``(B, g * r, 1, Dh)`` in slot order, as ``grouped_sdpa`` over the slots' gathered queries returns it (dead rows
    are the caller's, as there: their mask row is opened)."""
    B, _, S, _ = k.shape
    return compact_decode_attention(q, k, v, slot_lengths(selection, held), scale, kv_index=selection.kv_index,
                                    group_size=group_size, bias=request_bias(mask, B, S),
                                    check_index=False)  # select_kv builds it in range, once per request
