"""Dense multi-head attention over every head: what the unwrapped ``HeadAttention`` computes and what the
``masked`` executor gates afterwards (one place, so the two cannot drift apart)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.masks import build_attention_mask, dead_rows
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs, AttentionWeights


def split_heads(t: Tensor, head_dim: int, norm: Callable[[Tensor], Tensor] | None = None,
                rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A projection's output ``(B, S, h*Dh)`` as heads ``(B, h, S, Dh)``: through a per-head norm over ``Dh``
    first (Qwen3's ``q_norm``/``k_norm``), then rotary (``(cos, sin)``, each ``(B|1, S, Dh)``)."""
    t = t.unflatten(-1, (-1, head_dim))  # (B, S, h, Dh), a view
    if norm is not None:
        t = norm(t)
    t = t.transpose(1, 2)  # (B, h, S, Dh)
    return t if rotary is None else apply_rotary(t, *rotary)


def kv_heads(w: AttentionWeights, key_source: Tensor, value_source: Tensor,
             rotary: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Keys and values of every key/value head of ``key_source (B, S, Dk)`` / ``value_source (B, S, Dv)``:
    ``(B, Hkv, S, Dh)`` each, keys normalised per head and rotated (what a KV cache holds)."""
    Dh = w.layout.head_dim
    k = split_heads(F.linear(key_source, w.k_weight, w.k_bias), Dh, w.k_norm, rotary)
    return k, split_heads(F.linear(value_source, w.v_weight, w.v_bias), Dh)


def project_kv(w: AttentionWeights, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
    """Keys and values of every key/value head of a call, ``(B, Hkv, S, Dh)`` each (its cached ones if given)."""
    if inputs.key_states is not None and inputs.value_states is not None:
        return inputs.key_states, inputs.value_states
    return kv_heads(w, inputs.key_input, inputs.value_input, inputs.rotary)


# torch >= 2.5 reads grouped keys/values in place (no copy of the cache per call); 2.4 needs them repeated.
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
                 dropout_p: float = 0.0) -> Tensor:
    """SDPA of ``q (B, H, T, Dh)`` over grouped ``k``/``v`` ``(B, Hkv, S, Dh)``: query head h reads key/value head
    ``h // (H / Hkv)`` (GQA)."""
    group = q.shape[1] // k.shape[1]
    B, H, T, Dh = q.shape
    if group > 1 and T == 1 and not is_causal and dropout_p == 0.0 and (mask is None or mask.shape[1] == 1):
        # One query per head (decoding): a group's query heads become rows of one attention over their shared
        # keys, a plain SDPA call with no copy (0.6x the time of enable_gqa on CPU, B=8 S=2048).
        # reshape, not view: CUDA's fused kernels return (B, g, Hkv, Dh)-strided outputs (seen on an H200), and a
        # query projected through a transpose need not be contiguous either; both are copied only when needed
        out = F.scaled_dot_product_attention(q.reshape(B, H // group, group, Dh), k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, H, 1, Dh)
    if group > 1 and not _SDPA_GQA:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    extra = {"enable_gqa": True} if group > 1 and _SDPA_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, **extra)


def all_heads_attention(weights: AttentionWeights, inputs: AttentionInputs) -> tuple[Tensor, Tensor | None]:
    """Every head's attention output ``(B, H, T, Dh)`` and the dead query rows ``(B, T)`` (or None)."""
    x = inputs.x
    B, T, _ = x.shape
    L = weights.layout
    mask = build_attention_mask(inputs, L.causal, x.dtype)
    q = split_heads(F.linear(x, weights.q_weight, weights.q_bias), L.head_dim, weights.q_norm, inputs.rotary)
    k, v = project_kv(weights, inputs)  # (B, Hkv, S, Dh)
    out = grouped_sdpa(q, k, v, mask.mask, mask.is_causal, L.scale, inputs.dropout_p)  # (B, H, T, Dh)
    if mask.dead is not None:
        out = out.masked_fill(mask.dead.unsqueeze(-1), 0.0)
    return out, dead_rows(mask, B, T)
