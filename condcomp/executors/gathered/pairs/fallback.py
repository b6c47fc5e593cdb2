"""The pair ops' three primitives in torch (gather + batched matmuls): what runs where the Triton kernels do not
(CPU without the interpreter, float64, no triton). Same semantics as kernels.py, pair for pair: a pair
``j >= counts[b]`` contributes nothing, a row with ``counts[b] == 0`` gets no bias. It copies the selected weight
blocks per example; the kernels read them in place."""

from __future__ import annotations

import torch
from torch import Tensor


def active_pairs(heads: Tensor, counts: Tensor) -> Tensor:
    """``(B, C)`` bool: pair ``(b, j)`` is selected (``j < counts[b]``)."""
    return torch.arange(heads.shape[1], device=heads.device)[None] < counts[:, None]


def _coef(heads: Tensor, counts: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``(B, C)``: 0 on unselected pairs, else the pair's scale (1 without one)."""
    coef = active_pairs(heads, counts).to(dtype)
    return coef if scale is None else coef * scale.to(dtype)


def pair_matmul(x: Tensor, w: Tensor, bias: Tensor | None, scale: Tensor | None, heads: Tensor, counts: Tensor,
                out_dtype: torch.dtype) -> Tensor:
    """``out[b, j] = scale[b, j] * (x[b] @ w[h]^T + bias[h])``, ``h = heads[b, j]``: ``x (B, T, D)``, ``w (E, F, D)``
    -> ``(B, C, T, F)``, zeros on unselected pairs."""
    dtype = torch.promote_types(x.dtype, out_dtype)
    out = torch.matmul(x.to(dtype).unsqueeze(1), w.to(dtype)[heads].transpose(-1, -2))  # (B, C, T, F)
    if bias is not None:
        out = out + bias.to(dtype)[heads].unsqueeze(2)
    coef = _coef(heads, counts, scale, dtype)[:, :, None, None]
    return torch.where(coef != 0, out * coef, 0.0).to(out_dtype)


def pair_sum(a: Tensor, w: Tensor, scale: Tensor | None, bias: Tensor | None, heads: Tensor, counts: Tensor,
             out_dtype: torch.dtype) -> Tensor:
    """``y[b] = sum_{j < counts[b]} scale[b, j] * a[b, j] @ w[h]`` (+ ``bias`` where ``counts[b] > 0``): ``a (B, C, T,
    K)``, ``w (E, K, N)`` -> ``(B, T, N)``."""
    dtype = torch.promote_types(a.dtype, out_dtype)
    coef = _coef(heads, counts, scale, dtype)[:, :, None, None]
    a = torch.where(coef != 0, a.to(dtype) * coef, 0.0)
    y = torch.einsum("bctk,bckn->btn", a, w.to(dtype)[heads])  # (B, T, N)
    if bias is not None:
        y = y + bias.to(dtype) * (counts > 0).to(dtype)[:, None, None]
    return y.to(out_dtype)


def group_xty(g: Tensor, x: Tensor, scale: Tensor | None, heads: Tensor, counts: Tensor, num_heads: int,
              with_bias: bool, out_dtype: torch.dtype, dw_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``dw[e] = sum over selected pairs of head e of scale * g[b, j]^T @ x[b]`` ``(E, F, D)`` (written into
    ``dw_out`` when given) and, with ``with_bias``, ``db[e] = sum of scale * g[b, j]`` over rows ``(E, F)``:
    ``g (B, C, T, F)``, ``x (B, T, D)``."""
    dtype = torch.promote_types(g.dtype, out_dtype)
    coef = _coef(heads, counts, scale, dtype)  # (B, C)
    sel = (heads[..., None] == torch.arange(num_heads, device=heads.device)).to(dtype) * coef[..., None]  # (B, C, E)
    g = torch.where(coef[:, :, None, None] != 0, g.to(dtype), 0.0)
    per_head = torch.einsum("bce,bctf->betf", sel, g)  # (B, E, T, F)
    dw = torch.einsum("betf,btd->efd", per_head, x.to(dtype)).to(out_dtype)
    db = per_head.sum((0, 2)).to(out_dtype) if with_bias else None
    return (dw if dw_out is None else dw_out.copy_(dw)), db


def row_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor,
                  first: int, num_routed: int, group: int, is_causal: bool, scale: float) -> Tensor:
    """Same semantics as row_launch.row_attention in torch: each pair's query in its head's slot of a ``(B, E, T,
    Dh)`` block (dense over the routed heads), one SDPA call, each pair's row read back."""
    B, T, R, Dh = q.shape
    E = num_routed
    chosen = (torch.arange(R, device=q.device) < counts.unsqueeze(-1)).unsqueeze(-1)  # (B, T, R, 1)
    ix = slot.unsqueeze(-1).expand(B, T, R, Dh)
    block = q.new_zeros(B, T, E, Dh).scatter(2, ix, torch.where(chosen, q, 0.0)).transpose(1, 2)  # (B, E, T, Dh)
    kv = torch.div(torch.arange(first, first + E, device=q.device), group, rounding_mode="floor")
    m = mask if mask is None or mask.shape[1] == 1 else mask[:, first:first + E]
    out = torch.nn.functional.scaled_dot_product_attention(
        block, keys.index_select(1, kv), values.index_select(1, kv), attn_mask=m, is_causal=is_causal, scale=scale)
    return torch.where(chosen, out.transpose(1, 2).gather(2, ix), 0.0)  # (B, T, R, Dh)
