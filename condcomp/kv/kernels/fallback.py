"""The split-K decode attention in torch: what runs where the Triton kernels do not (CPU without the interpreter,
float64, no triton). Same semantics as split_k.py: masked attention of each (request, slot)'s query heads over the
slot's keys ``[0, length)`` plus ``bias``, in float32 at least; a row with no readable key outputs zeros. It reads
every pool position (masked); the kernels read only the blocks below each length. ``block_n`` and ``split_n`` (the
kernels' tiling) change nothing here."""

from __future__ import annotations

import torch
from torch import Tensor


def query_heads(kv_index: Tensor | None, B: int, G: int, group_size: int, device: torch.device) -> Tensor:
    """``(B, G * R)``: the query head each output row reads, slot ``g``'s ``R`` heads in order
    (``kv_index[b, g] * R + j``; slot ``g`` is group ``g`` without an index)."""
    groups = torch.arange(G, device=device).expand(B, G) if kv_index is None else kv_index.long()
    return (groups.unsqueeze(-1) * group_size + torch.arange(group_size, device=device)).flatten(1)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float, kv_index: Tensor | None,
                     group_size: int, bias: Tensor | None, block_n: int, split_n: int) -> Tensor:
    B, G, S, Dh = k.shape
    R = group_size
    wide = torch.promote_types(q.dtype, torch.float32)
    heads = query_heads(kv_index, B, G, R, q.device)  # (B, G*R)
    qs = q[:, :, 0].to(wide).gather(1, heads.unsqueeze(-1).expand(B, G * R, Dh)).view(B, G, R, Dh)
    s = torch.einsum("bgrd,bgsd->bgrs", qs, k.to(wide)) * scale  # (B, G, R, S)
    if bias is not None:
        s = s + bias.to(wide)[:, None, None, :]
    valid = torch.arange(S, device=q.device) < lengths.to(q.device).unsqueeze(-1)  # (B, G, S)
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    top = s.amax(-1, keepdim=True) if S else s.new_zeros(B, G, R, 1)
    p = torch.exp(s - torch.where(torch.isneginf(top), 0.0, top))  # a row of -inf: p = 0, not NaN
    total = p.sum(-1, keepdim=True)  # (B, G, R, 1)
    kept = v.to(wide).masked_fill(~valid.unsqueeze(-1), 0.0)  # unread positions: 0 * NaN would be NaN
    out = torch.einsum("bgrs,bgsd->bgrd", p, kept) / torch.where(total > 0, total, 1.0)
    return out.reshape(B, G * R, 1, Dh).to(q.dtype)
