"""Blocks every gathered strategy shares: head-row selection, projections of a head list, the k-head block.

A "k-head block" is ordinary attention restricted to a fixed list of heads for every row: their q/k/v rows of the
projections, one SDPA call, and the output projection on their columns only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from condcomp.masks import AttentionMask
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs, AttentionWeights


def is_range(ix: list[int]) -> bool:
    """Whether ``ix`` is a non-empty contiguous ascending range (then a slice selects it: a view, no copy)."""
    return bool(ix) and ix == list(range(ix[0], ix[0] + len(ix)))


def head_rows(w: Tensor, heads: list[int], Dh: int) -> Tensor:
    """The ``Dh``-row blocks of ``heads`` of an ``(n * Dh, ...)`` weight or bias, concatenated (a view when the
    heads are a contiguous ascending range)."""
    if is_range(heads):
        return w[heads[0] * Dh:(heads[0] + len(heads)) * Dh]
    return torch.cat([w[h * Dh:(h + 1) * Dh] for h in heads]) if heads else w[:0]


_INDEX_CACHE: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def index(ix: list[int], device: torch.device) -> Tensor:
    """``ix`` as a device tensor, cached: a fresh host-to-device copy per call would stall the CUDA stream."""
    key = (tuple(ix), device)
    if key not in _INDEX_CACHE:
        if len(_INDEX_CACHE) > 4096:
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = torch.tensor(ix, dtype=torch.long, device=device)
    return _INDEX_CACHE[key]


def take(t: Tensor, ix: list[int]) -> Tensor:
    """``t[:, ix]``, as a view when ``ix`` is a contiguous ascending range."""
    if is_range(ix):
        return t[:, ix[0]:ix[0] + len(ix)]
    return t.index_select(1, index(ix, t.device))


def heads_of(t: Tensor, heads: list[int]) -> Tensor:
    """Dim 1 of a mask-like ``(B|1, H|1, ...)`` tensor restricted to ``heads`` (kept at 1 when broadcast)."""
    return t if t.shape[1] == 1 else take(t, heads)


def batched_project(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``x (n, T, D) @ w (n, F, D)^T (+ b (n, F))`` -> ``(n, T, F)``."""
    if b is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


def project_heads(w: AttentionWeights, inputs: AttentionInputs, q_heads: list[int],
                  kv_heads: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Queries ``(B, len(q_heads), T, Dh)`` and keys/values ``(B, len(kv_heads), S, Dh)`` of the listed heads,
    rotary applied to the queries and to freshly projected keys (a KV cache is already rotated)."""
    Dh = w.layout.head_dim
    x = inputs.x
    nq, nkv = len(q_heads), len(kv_heads)

    def bias(b: Tensor | None, heads: list[int]) -> Tensor | None:
        return None if b is None else head_rows(b, heads, Dh)

    def heads_first(t: Tensor, n: int) -> Tensor:
        return rearrange(t, "b t (n d) -> b n t d", n=n, d=Dh)  # a view; n = 0 is allowed

    cached = inputs.key_states is not None and inputs.value_states is not None
    if inputs.key is None and inputs.value is None and not cached:  # self-attention: one fused projection
        parts = ((w.q_weight, w.q_bias, q_heads), (w.k_weight, w.k_bias, kv_heads), (w.v_weight, w.v_bias, kv_heads))
        wt = torch.cat([head_rows(wp, heads, Dh) for wp, _, heads in parts])
        fused_b = None
        if any(b is not None for _, b, _ in parts):  # a missing bias (e.g. no key bias) is a zero block
            fused_b = torch.cat([x.new_zeros(len(heads) * Dh) if b is None else head_rows(b, heads, Dh)
                                 for _, b, heads in parts])
        q, k, v = F.linear(x, wt, fused_b).split([nq * Dh, nkv * Dh, nkv * Dh], -1)
        q, k, v = heads_first(q, nq), heads_first(k, nkv), heads_first(v, nkv)
    else:
        q = heads_first(F.linear(x, head_rows(w.q_weight, q_heads, Dh), bias(w.q_bias, q_heads)), nq)
        if inputs.key_states is not None and inputs.value_states is not None:
            k, v = inputs.key_states[:, kv_heads], inputs.value_states[:, kv_heads]
        else:
            k = heads_first(F.linear(inputs.key_input, head_rows(w.k_weight, kv_heads, Dh),
                                     bias(w.k_bias, kv_heads)), nkv)
            v = heads_first(F.linear(inputs.value_input, head_rows(w.v_weight, kv_heads, Dh),
                                     bias(w.v_bias, kv_heads)), nkv)
    q = w.norm_queries(q)
    if inputs.key_states is None:
        k = w.norm_keys(k)
    if inputs.rotary is not None:
        q = apply_rotary(q, *inputs.rotary)
        if inputs.key_states is None:
            k = apply_rotary(k, *inputs.rotary)
    return q, k, v


def heads_block(w: AttentionWeights, inputs: AttentionInputs, mask: AttentionMask, heads: list[int], q: Tensor,
                keys: Tensor, values: Tensor, gates: Tensor, o_bias: Tensor | None) -> Tensor:
    """``(B, T, D)`` of a fixed head list for every row: queries ``(B, n, T, Dh)``, keys/values per query head
    ``(B, n, S, Dh)``, gates ``(B, n, T|1, 1)``; the output projection uses only these heads' columns."""
    x = inputs.x
    B, T, _ = x.shape
    Dh = w.layout.head_dim
    m = None if mask.mask is None else heads_of(mask.mask, heads)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=m, dropout_p=inputs.dropout_p,
                                         is_causal=mask.is_causal, scale=w.layout.scale)  # (B, n, T, Dh)
    if mask.dead is not None:
        out = out.masked_fill(heads_of(mask.dead, heads).unsqueeze(-1), 0.0)
    out = out * gates.to(out.dtype)
    wo = take(w.o_weight.view(-1, w.layout.num_heads, Dh), heads).flatten(1)  # (D, n*Dh)
    return F.linear(rearrange(out, "b n t d -> b t (n d)"), wo, o_bias).to(x.dtype)
