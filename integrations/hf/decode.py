"""Per-request plans with a KV cache for projection-style decoders (Llama, Qwen2/3, Mistral, Gemma).

At inference with a cache, a sequence plan is decided once, at the request's prefill, and held for its later
calls (:mod:`condcomp.kv.selection`). The key/value heads the plan keeps are the only ones projected, cached and
read: the cache holds ``(B, g, S, Dh)`` with ``g`` the batch's largest number of kept KV groups, in the order of
:class:`~condcomp.kv.selection.KVSelection`; the groups it does not keep get the layer's KV policy
(:mod:`condcomp.kv.policy`). Query heads inside a kept group that the plan skips are computed with gate 0 (at
decode a group's cost is reading its keys and values, shared by its query heads); the output projection reads the
kept heads' outputs scattered back to their columns, so LoRA and biases behave as in the module. At the full budget
(every group kept, gates 1) nothing is gathered or scattered: this is dense attention.

A call reads top-down: :func:`request_call` (which mode: the held plan, a plan decided now, or every head cached)
-> :func:`held_attention` (transformers' arguments as :class:`~condcomp.types.AttentionInputs` carrying the
compact cache) -> the executor ``resolve_executor`` picks (``kv_cache``) -> the KV policy -> the cache layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from condcomp.executors.auto import resolve_executor
from condcomp.executors.cached import CompactKV, Projections
from condcomp.host import LastForward
from condcomp.kv.choose import kv_policy_of
from condcomp.kv.selection import KVSelection, pad_slots, select_kv
from condcomp.types import AttentionInputs, HeadPlan

from .cache import LayerSlot, RequestStep, cache_layer, compact_write, open_step, placeholder_width
from .common import decoder_request_plan, mask_parts, sliding_window_bias
from .internals import is_static_cache, layer_initialized, reallocate_static_layer

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


def request_call(routed: RoutedAttention, x: Tensor, rotary: tuple[Tensor, Tensor] | None, cache: Any,
                 layer_idx: int, mask: Any, sliding_window: int | None, extra: dict[str, Any]
                 ) -> tuple[Tensor | None, RequestStep, HeadPlan]:
    """A decoder call on a KV cache: ``(y, step, plan)`` with ``y`` computed on the compact cache when the request
    has (or now gets) a sequence plan at inference; ``y`` None when every key/value head must be cached (a per-token
    plan, a plan decided in training, a cache of every head): the caller then computes with ``plan``."""
    B, T = x.shape[:2]
    step = open_step(routed, cache, layer_idx, B, T)
    held = step.held
    if held is not None and held.selection is not None:  # a later call of a request on its compact cache
        y = held_attention(routed, held.plan, held.selection, x, rotary, step, mask, sliding_window, extra)
        return y, step, held.plan
    plan = decoder_request_plan(routed, step, x, mask)
    if held is None and plan.granularity == "sequence" and not routed.training:  # a request's first call
        selection = compact_selection(routed, plan, step, sliding_window)
        y = held_attention(routed, plan, selection, x, rotary, step, mask, sliding_window, extra)
        step.keep(routed, plan, selection)
        return y, step, plan
    return None, step, plan


def compact_selection(routed: RoutedAttention, plan: HeadPlan, step: RequestStep,
                      sliding_window: int | None = None) -> KVSelection:
    """The slots of a plan decided now; a static cache layer allocated earlier fixes the slot count. On a layer
    with its own ``sliding_window`` the KV policy's groups read only within it too (never a key the model's rule
    excludes)."""
    policy = kv_policy_of(routed)
    if sliding_window is not None:
        policy = policy.within_model_window(int(sliding_window))
    selection = select_kv(plan, routed.layout, policy)
    layer = cache_layer(step.cache, step.layer_idx)
    static = is_static_cache(step.cache, layer)
    if selection.window_index is not None and static:
        raise ValueError(f"the KV policy {policy.name!r} keeps the groups a plan does not keep in a state of its own "
                         "(streamed key/value groups: a trimmed window) beside the cache, which a static cache cannot "
                         "hold: generate with the default DynamicCache")
    slots = getattr(layer, "num_heads", None) if layer_initialized(layer) else None
    if isinstance(slots, int) and hasattr(layer, "max_cache_len"):  # static: (B, slots, max_len, Dh) allocated
        if selection.slots <= slots:
            return pad_slots(selection, slots)
        reallocate_static_layer(layer)  # an empty static layer too small for this plan: allocated again
    return selection


def held_attention(routed: RoutedAttention, plan: HeadPlan, sel: KVSelection, x: Tensor,
                   rotary: tuple[Tensor, Tensor] | None, step: RequestStep, mask: Any, sliding_window: int | None,
                   extra: dict[str, Any]) -> Tensor:
    """One call under a request's plan: ``x (B, T, D)`` -> ``(B, T, D)``. Translates transformers' arguments
    (mask, cache, projections) into an executor call whose inputs carry the compact cache; the executor is the one
    ``resolve_executor`` picks for it (``kv_cache``) and gives the call's usage record."""
    cache, layer_idx = step.cache, step.layer_idx
    L = routed.layout
    B, T, _ = x.shape
    if B == 0:  # an empty batch: nothing to attend, the cache still learns the call's length
        empty = x.new_zeros(B, 0, T, L.head_dim)
        with compact_write():
            cache.update(empty, empty, layer_idx, kwargs=extra)
        return x.new_zeros(B, T, L.d_model)
    S = mask.shape[-1] if isinstance(mask, Tensor) else step.query_start + T  # keys after this call's update
    query_mask, key_mask, bias = mask_parts(mask, B, T, S, True, step.query_start)
    if mask is None and sliding_window is not None and S > sliding_window:
        bias = sliding_window_bias(T, S, int(sliding_window), x.device, x.dtype)
    slot = LayerSlot(cache, layer_idx, extra, sel.policy)
    proj = Projections(routed.q_proj, routed.k_proj, routed.v_proj, routed.o_proj,  # the modules: exact for LoRA
                       getattr(routed, "q_norm", None), getattr(routed, "k_norm", None))
    windows = slot.state() if step.held is not None else None
    # no group kept in full: the full-length tensor is a placeholder that counts the tokens
    width = placeholder_width(cache_layer(cache, layer_idx), B, T, step.held is None) if sel.slots == 0 else 1
    compact = CompactKV(sel, slot.store, S if mask is None else None, windows, slot.keep_windows, proj, width)
    inputs = AttentionInputs(x=x, mask=query_mask, key_mask=key_mask, attn_bias=bias, rotary=rotary,
                             dropout_p=L.dropout_p if routed.training else 0.0, kv_cache=compact)
    weights = routed.weights()
    run = resolve_executor(routed.executor, weights, inputs, plan)
    y: Tensor = run(weights, inputs, plan)
    # head_usage reports this call (a decode step's T and keys), not the prefill's
    last = routed.last
    s = last.s if last is not None and tuple(last.s.shape) == (B,) else plan.counts.float() / plan.num_heads
    usage = getattr(run, "usage", None)
    routed.last = (usage(s, plan, query_mask, T, S, kv_policy_of(routed).needs_cache) if callable(usage) else
                   LastForward(s, plan, query_mask, T, S, getattr(run, "name", None), getattr(run, "strategy", None)))
    return y
