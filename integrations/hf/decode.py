"""Per-request plans with a KV cache for projection-style decoders (Llama, Qwen2/3, Mistral, Gemma).

At inference with a cache, a sequence plan is decided once, at the request's prefill, and held for its later
calls (:mod:`condcomp.held_plans`). The key/value heads the plan keeps are the only ones projected, cached and
read: the cache holds ``(B, g, S, Dh)`` with ``g`` the batch's largest number of kept KV groups, in the order of
:class:`~condcomp.held_plans.KVSelection`. Query heads inside a kept group that the plan skips are computed with
gate 0 (at decode a group's cost is reading its keys and values, shared by its query heads); the output
projection reads the kept heads' outputs scattered back to their columns, so LoRA and biases behave as in the
module. At the full budget (every group kept, gates 1) nothing is gathered or scattered: this is dense attention.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from condcomp.dense import grouped_sdpa
from condcomp.held_plans import KVSelection, pad_slots, select_kv
from condcomp.masks import build_attention_mask, dead_rows
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs, HeadPlan

from .cache import RequestStep, cache_layer, compact_write
from .common import decoder_request_plan, mask_parts, sliding_window_bias, visible_keys

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


def decide_request_plan(routed: RoutedAttention, x: Tensor, mask: Any, step: RequestStep) -> HeadPlan:
    """The request's plan for this call: the one stored in the cache, or one decided now from the call's real
    tokens (at the request's first call; a sequence plan on a cache that holds tokens but no plan is refused)."""
    plan = decoder_request_plan(routed, step, x, mask)
    if step.held is None and plan.granularity == "sequence" and routed.last is not None:
        routed.last = replace(routed.last, executor="held", strategy="kv_cache")
    return plan


def compact_selection(routed: RoutedAttention, plan: HeadPlan, step: RequestStep) -> KVSelection:
    """The slots of a plan decided now; a static cache layer allocated earlier fixes the slot count."""
    selection = select_kv(plan, routed.layout)
    layer = cache_layer(step.cache, step.layer_idx)
    slots = getattr(layer, "num_heads", None) if getattr(layer, "is_initialized", False) else None
    if isinstance(slots, int) and hasattr(layer, "max_cache_len"):  # static: (B, slots, max_len, Dh) allocated
        if selection.slots <= slots:
            return pad_slots(selection, slots)
        layer.is_initialized = False  # an empty static layer too small for this plan: allocated again
    return selection


def held_attention(routed: RoutedAttention, sel: KVSelection, x: Tensor, rotary: tuple[Tensor, Tensor] | None,
                   step: RequestStep, mask: Any, sliding_window: int | None, extra: dict[str, Any]) -> Tensor:
    """One call under a request's plan: ``x (B, T, D)`` -> ``(B, T, D)``, caching the kept key/value heads only."""
    cache, layer_idx = step.cache, step.layer_idx
    L = routed.layout
    B, T, _ = x.shape
    Hkv, r, Dh, g = L.num_kv_heads, L.group_size, L.head_dim, sel.slots
    if g == 0:  # an empty batch (select_kv gives every non-empty batch at least one slot)
        empty = x.new_zeros(B, 0, T, Dh)
        with compact_write():
            cache.update(empty, empty, layer_idx, kwargs=extra)
        return x.new_zeros(B, T, L.d_model)
    # The projections' own forward (exact for LoRA layers), then the kept groups of each row.
    q = routed.q_proj(x).view(B, T, Hkv, r, Dh)
    k = routed.k_proj(x).view(B, T, Hkv, Dh)
    v = routed.v_proj(x).view(B, T, Hkv, Dh)
    if not sel.identity:
        idx = sel.kv_index[:, None, :, None]  # (B, 1, g, 1)
        q = q.gather(2, idx.unsqueeze(-1).expand(B, T, g, r, Dh))
        k = k.gather(2, idx.expand(B, T, g, Dh))
        v = v.gather(2, idx.expand(B, T, g, Dh))
    q = q.reshape(B, T, g * r, Dh)
    if getattr(routed, "q_norm", None) is not None:  # Qwen3: per-head norms before rotary
        q = routed.q_norm(q)
    if getattr(routed, "k_norm", None) is not None:
        k = routed.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, g*r | g, T, Dh)
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    with compact_write():
        k, v = cache.update(k, v, layer_idx, kwargs=extra)  # (B, g, S, Dh): the kept groups' whole history
    k, v = visible_keys(k, v, mask, step.query_start, T)
    S = k.shape[2]
    query_mask, key_mask, bias = mask_parts(mask, B, T, S, True, step.query_start)
    if mask is None and sliding_window is not None and S > sliding_window:
        bias = sliding_window_bias(T, S, int(sliding_window), x.device, x.dtype)
    am = build_attention_mask(AttentionInputs(x=x, mask=query_mask, key_mask=key_mask, attn_bias=bias,
                                              key_states=k, value_states=v), L.causal, q.dtype)
    out = grouped_sdpa(q, k, v, am.mask, am.is_causal, L.scale,
                       L.dropout_p if routed.training else 0.0)  # (B, g*r, T, Dh)
    if am.dead is not None:  # queries with no key to attend (all padding) output zeros, as every executor does
        out = out.masked_fill(am.dead.unsqueeze(-1), 0.0)
    if not sel.unit_gates:
        out = out * sel.slot_gates[:, :, None, None].to(out.dtype)
    out = out.transpose(1, 2).reshape(B, T, g, r * Dh)
    if not sel.identity:  # back to the heads' columns; spare slots add exact zeros
        full = out.new_zeros(B, T, Hkv, r * Dh)
        out = full.scatter_add(2, sel.kv_index[:, None, :, None].expand(B, T, g, r * Dh), out)
    y = routed.o_proj(out.reshape(B, T, Hkv * r * Dh))
    if sel.row_active is not None:  # a row with no active head outputs exactly zero (no output bias)
        y = torch.where(sel.row_active[:, None, None], y, torch.zeros_like(y))
    dead = dead_rows(am, B, T)  # (B, T) or None: all-padding queries output zeros, bias included
    return y if dead is None else y.masked_fill(dead.unsqueeze(-1), 0.0)  # type: ignore[no-any-return]
