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


def _routed_scores(q: Tensor, keys: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor, first: int,
                   num_routed: int, group: int, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The routed block's scores in ``wide`` (float32 at least): ``(B, E, T, S)``, ``-inf`` where a key is not
    allowed; with ``chosen (B, T, R, 1)``, the slot index ``ix (B, T, R, Dh)`` and each routed head's key head."""
    B, T, R, Dh = q.shape
    E, S = num_routed, keys.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    chosen = (torch.arange(R, device=q.device) < counts.unsqueeze(-1)).unsqueeze(-1)  # (B, T, R, 1)
    ix = slot.unsqueeze(-1).expand(B, T, R, Dh)
    block = _to_block(torch.where(chosen, q, 0.0).to(wide), ix, E)  # (B, E, T, Dh)
    kv = torch.div(torch.arange(first, first + E, device=q.device), group, rounding_mode="floor")
    sc = torch.matmul(block, keys.index_select(1, kv).to(wide).transpose(-1, -2)) * scale  # (B, E, T, S)
    allowed = torch.ones(T, S, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = torch.ones_like(allowed).tril()  # key s <= row t (top-left aligned, as SDPA's is_causal)
    if mask is not None:
        m = mask if mask.shape[1] == 1 else mask[:, first:first + E]
        if m.is_floating_point():
            sc = sc + m.to(wide)
        else:
            allowed = allowed & m
    return sc.masked_fill(~allowed, float("-inf")), chosen, ix, kv


def _to_block(rows: Tensor, ix: Tensor, E: int) -> Tensor:
    """``(B, T, R, Dh)`` rows in their heads' slots of a ``(B, E, T, Dh)`` block (zeros in the other slots)."""
    B, T, _, Dh = rows.shape
    return rows.new_zeros(B, T, E, Dh).scatter(2, ix, rows).transpose(1, 2)


def _from_block(block: Tensor, ix: Tensor, chosen: Tensor) -> Tensor:
    """Each pair's row of a ``(B, E, T, Dh)`` block: ``(B, T, R, Dh)``, zeros on unselected pairs."""
    return torch.where(chosen, block.transpose(1, 2).gather(2, ix), 0.0)


def row_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor,
                  first: int, num_routed: int, group: int, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Same semantics as row_launch.row_attention in torch: each pair's query in its head's slot of a ``(B, E, T,
    Dh)`` block (dense over the routed heads), softmax in float32 at least, each pair's row read back. ->
    ``(B, T, R, Dh)`` (zeros on unselected pairs and rows with no allowed key) and the rows' log-sum-exp ``(B, T, R)``
    (``+inf`` there, so that ``exp(score - lse)`` is 0)."""
    sc, chosen, ix, kv = _routed_scores(q, keys, mask, slot, counts, first, num_routed, group, is_causal, scale)
    lse = torch.logsumexp(sc, -1)  # (B, E, T)
    lse = torch.where(torch.isfinite(lse), lse, float("inf"))  # no allowed key: +inf, the row's output 0
    out = torch.matmul(torch.exp(sc - lse.unsqueeze(-1)), values.index_select(1, kv).to(sc.dtype))  # (B, E, T, Dh)
    lse_rows = torch.where(chosen.squeeze(-1), lse.transpose(1, 2).gather(2, slot), float("inf"))  # (B, T, R)
    return _from_block(out, ix, chosen).to(q.dtype).contiguous(), lse_rows.contiguous()


def row_attention_backward(grad: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor,
                           counts: Tensor, out: Tensor, lse: Tensor, first: int, num_routed: int, group: int,
                           is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`row_attention` from its output's gradient, the probabilities recomputed from the
    saved log-sum-exp (FlashAttention's backward, on the routed block): zeros for unselected pairs, the key/value
    gradients of each KV head summed over the routed heads of its group (shapes of ``keys``/``values``)."""
    sc, chosen, ix, kv = _routed_scores(q, keys, mask, slot, counts, first, num_routed, group, is_causal, scale)
    wide, E = sc.dtype, num_routed
    B, T, R, _ = q.shape
    lse_b = lse.new_full((B, T, E), float("inf")).scatter(2, slot, torch.where(chosen.squeeze(-1), lse, float("inf")))
    p = torch.exp(sc - lse_b.transpose(1, 2).to(wide).unsqueeze(-1))  # (B, E, T, S)
    d_out = _to_block(torch.where(chosen, grad, 0.0).to(wide), ix, E)  # (B, E, T, Dh)
    delta = (d_out * _to_block(out.to(wide), ix, E)).sum(-1, keepdim=True)  # (B, E, T, 1)
    ds = p * (torch.matmul(d_out, values.index_select(1, kv).to(wide).transpose(-1, -2)) - delta)
    dq = _from_block(torch.matmul(ds, keys.index_select(1, kv).to(wide)) * scale, ix, chosen)
    group_of = (kv[:, None] == torch.arange(keys.shape[1], device=kv.device)).to(wide)  # (E, Hkv): a fixed sum order
    dk = torch.einsum("besd,ek->bksd", torch.matmul(ds.transpose(-1, -2), _to_block(
        torch.where(chosen, q, 0.0).to(wide), ix, E)) * scale, group_of)
    dv = torch.einsum("besd,ek->bksd", torch.matmul(p.transpose(-1, -2), d_out), group_of)
    return dq.to(q.dtype).contiguous(), dk.to(keys.dtype).contiguous(), dv.to(values.dtype).contiguous()
