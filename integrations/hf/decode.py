"""The decoder sequence every transformers family shares: a decoder self-attention call on a KV cache.

A family (:mod:`.projection` for Llama, Qwen2/3, Mistral, Gemma; :mod:`.gpt2`; :mod:`.t5`'s decoder; :mod:`.bert`
as a decoder) only translates its arguments into a :class:`DecoderCall` (its projections, rotary, extra per-head
score terms such as T5's position bias, the layer's own sliding window) and calls :func:`decoder_attention`, which
reads top-down: open the step (what the cache holds, read once) -> the plan (held, or decided now) -> the call
translated once into plain tensors and the cache layer (:func:`held_attention`) and handed to the base decoder
sequence on the compact cache, :func:`condcomp.kv.decoder.attend_compact` (the executor ``resolve_executor`` picks,
``kv_cache``, then the KV policy, then the cache layer, with no call back up here) -> or, where a request's plan
cannot be held (a per-token plan, a plan decided in training), every head cached and attended with the plan
(:func:`every_head_attention`).

At inference with a cache, a sequence plan is decided once, at the request's prefill, and held for its later
calls (:mod:`condcomp.kv.selection`). The key/value heads the plan keeps are the only ones cached and read: the
cache holds ``(B, g, S, Dh)`` with ``g`` the batch's largest number of kept KV groups, in the order of
:class:`~condcomp.kv.selection.KVSelection`; the groups it does not keep get the layer's KV policy
(:mod:`condcomp.kv.policy`). Query heads inside a kept group that the plan skips are computed with gate 0 (at
decode a group's cost is reading its keys and values, shared by its query heads); the output projection reads the
kept heads' outputs scattered back to their columns, so LoRA and biases behave as in the module. At the full budget
(every group kept, gates 1) nothing is gathered or scattered: this is dense attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from condcomp.dense import split_heads
from condcomp.kv.choose import kv_policy_of
from condcomp.kv.decoder import CompactCall, attend_compact, score_terms
from condcomp.kv.fixed_slots import refuse_position_bias
from condcomp.kv.policy import KVPolicy
from condcomp.kv.position_bias import RelativeBias
from condcomp.kv.selection import KVSelection, pad_slots, select_kv
from condcomp.kv.window import revertible_tail
from condcomp.types import AttentionWeights, HeadPlan, Projections

from .cache import RequestStep, cache_layer, compact_layer, offloaded_store, open_step, placeholder_width
from .common import attend_call, cache_every_head, decoder_request_plan
from .internals import is_static_cache, layer_initialized, reallocate_static_layer

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


@dataclass(frozen=True)
class DecoderCall:
    """A decoder self-attention call on a KV cache as a family translates it: all the base sequence reads.

    - ``x``: the queries' input ``(B, T, D)``; ``mask``: transformers' attention mask (or None); ``extra``: the
      call's other keyword arguments, passed to the cache's ``update`` (``cache_position``, ...).
    - ``cache``, ``layer_idx``: the request's cache (an ``EncoderDecoderCache`` is read through its self-attention
      half) and the layer's index in it.
    - ``projections``: the layer's q/k/v/o as the module runs them (its own forwards: exact for LoRA).
    - ``rotary``: ``(cos, sin)``, each ``(B, T, Dh)``, or None; ``sliding_window``: the layer's own window or None.
    - ``weights``: the layer's canonical weights, when the family has them at hand (else read from the layer).
    - ``score_bias``: a per-head term added to the scores, ``(B|1, H, T, S)`` over the ``S`` keys after the call
      (T5's relative position bias), or None; ``relative_bias``: the same bias as a function of the distance from
      query to key (:class:`~condcomp.kv.position_bias.RelativeBias`), which a KV policy's groups add at their kept
      keys' true positions, or None.
    """

    x: Tensor
    cache: Any
    layer_idx: int
    mask: Any
    extra: dict[str, Any]
    projections: Projections
    rotary: tuple[Tensor, Tensor] | None = None
    sliding_window: int | None = None
    score_bias: Tensor | None = None
    relative_bias: RelativeBias | None = None
    weights: AttentionWeights | None = None  # the layer's canonical weights (default: read from the layer)

    @property
    def self_cache(self) -> Any:
        """The cache this layer's keys go to (the self-attention half of an ``EncoderDecoderCache``)."""
        return getattr(self.cache, "self_attention_cache", self.cache)

    def num_keys(self, past: int | Tensor) -> int:
        """Keys after this call's update (a static cache's mask covers its whole length) given ``past`` tokens."""
        if isinstance(self.mask, Tensor):
            return int(self.mask.shape[-1])
        assert isinstance(past, int)  # a device count comes with transformers' mask (its static pool read whole)
        return past + self.x.shape[1]


def decoder_attention(routed: RoutedAttention, call: DecoderCall) -> Tensor:
    """A decoder self-attention call on a KV cache: ``call.x (B, T, D)`` -> ``(B, T, D)`` (before any residual or
    norm the family adds), on the request's compact cache when it has (or now gets) a sequence plan at inference."""
    y, step, plan = request_call(routed, call)
    return y if y is not None else every_head_attention(routed, call, step, plan)


def refuse_kv_policy_outside_decoder(routed: RoutedAttention, what: str) -> None:
    """Refuse a call of a layer that is not a decoder's self-attention (``what``: cross-attention, an encoder's
    self-attention) under a KV policy that keeps the groups a plan does not keep: such a layer holds no request's
    growing cache, so those groups would be skipped, not kept."""
    policy = kv_policy_of(routed)
    if policy.needs_cache:
        raise ValueError(
            f"{type(routed.base).__name__} ({what}): the KV policy {policy.name!r} says what a decoder request's "
            "self-attention KV cache keeps of the key/value groups a plan does not keep; this layer holds no such "
            "cache, so its unkept heads would be skipped instead. Wrap only the decoder's self-attention layers "
            "(CondCompConfig(target_modules=[...]) or exclude_modules=[...]), or use kv='drop' (the default)")


def request_call(routed: RoutedAttention, call: DecoderCall) -> tuple[Tensor | None, RequestStep, HeadPlan]:
    """``(y, step, plan)`` with ``y`` computed on the compact cache when the request has (or now gets) a sequence
    plan at inference; ``y`` None when every key/value head must be cached (a per-token plan, a plan decided in
    training, a cache of every head): :func:`every_head_attention` then computes with ``plan``."""
    B, T = call.x.shape[:2]
    step = open_step(routed, call.self_cache, call.layer_idx, B, T)
    held = step.held
    if held is not None and held.selection is not None:  # a later call of a request on its compact cache
        return held_attention(routed, held.plan, held.selection, call, step), step, held.plan
    plan = decoder_request_plan(routed, step, call.x, call.mask)
    if held is None and plan.granularity == "sequence" and not routed.training:  # a request's first call
        selection = compact_selection(routed, plan, step, call.sliding_window)
        prompt_len = getattr(routed, "prompt_len", None)  # plan_from_prompt: the caller says where the prompt ends
        # candidates after the prompt (assisted decoding); a call holding the whole prompt ends it
        with revertible_tail(step.after_prompt, prompt_len is not None and call.x.shape[1] >= prompt_len):
            y = held_attention(routed, plan, selection, call, step)
        step.keep(routed, plan, selection)
        return y, step, plan
    return None, step, plan


def every_head_attention(routed: RoutedAttention, call: DecoderCall, step: RequestStep, plan: HeadPlan) -> Tensor:
    """The call with every key/value head cached (a head this token skips may be chosen by a later one)."""
    proj, Dh = call.projections, routed.layout.head_dim
    _, k, v = proj.project(call.x)
    keys, values = cache_every_head(call.self_cache, call.layer_idx, split_heads(k, Dh, proj.k_norm, call.rotary),
                                    split_heads(v, Dh), call.extra, call.mask, step)  # (B, Hkv, S, Dh) each
    return attend_call(routed, call.x, call.mask, step=step, plan=plan, decoder=True, key_states=keys,
                       value_states=values, rotary=call.rotary,
                       extra_bias=score_terms(call, call.x.shape[1], keys.shape[2], None))


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
        refuse_on_static(policy, bool(getattr(routed.adapter, "adds_position_bias", False)))
    slots = getattr(layer, "num_heads", None) if layer_initialized(layer) else None
    if isinstance(slots, int) and hasattr(layer, "max_cache_len"):  # static: (B, slots, max_len, Dh) allocated
        if selection.slots <= slots:
            return pad_slots(selection, slots)
        reallocate_static_layer(layer)  # an empty static layer too small for this plan: allocated again
    return selection


def refuse_on_static(policy: KVPolicy, position_bias: bool = False) -> None:
    """Refuse, by name, a KV policy whose groups a static cache cannot hold: one whose state does not stay a fixed
    number of slots after the prefill (``holds_fixed_slots``), a window inside the model's own sliding window, or
    slots on a model that adds a relative position bias to its scores (``position_bias``: T5). Refused at the
    request's prefill, which runs eagerly: a compiled decode step would meet the refusal inside the graph."""
    if position_bias:
        refuse_position_bias(policy.name)
    if not policy.holds_fixed_slots:
        raise ValueError(f"the KV policy {policy.name!r} keeps the groups a plan does not keep in a state of its own "
                         "that does not hold a fixed number of slots after the prefill, which a static cache cannot "
                         "hold: generate with the default DynamicCache (it then runs eagerly)")
    if getattr(policy, "model_window", None) is not None:
        raise ValueError(f"the KV policy {policy.name!r} on a layer with the model's own sliding window cannot be "
                         "preallocated in a static cache: generate with the default DynamicCache")


def held_attention(routed: RoutedAttention, plan: HeadPlan, sel: KVSelection, call: DecoderCall,
                   step: RequestStep) -> Tensor:
    """One call under a request's plan: ``call.x (B, T, D)`` -> ``(B, T, D)``. Translates the call once (the cache
    layer, where the queries start, how the layer is written, the weights) into a
    :class:`~condcomp.kv.decoder.CompactCall`, which :func:`~condcomp.kv.decoder.attend_compact` runs down: the
    executor ``resolve_executor`` picks (``kv_cache``), the KV policy, the cache layer."""
    cache, layer_idx, x = step.cache, step.layer_idx, call.x
    B, T = x.shape[:2]
    # condcomp's cache layer: the executor writes the kept groups through it (read by open_step at a decode step)
    layer = step.layer if step.layer is not None else compact_layer(cache, layer_idx)
    store = None
    if getattr(cache, "offloading", False):  # transformers prefetches and offloads the layer around its update
        store = functools.partial(offloaded_store, cache, layer_idx, call.extra)
    on_device = isinstance(step.query_start, Tensor)
    pool = int(layer.get_max_length()) if on_device and call.mask is None else None  # a static pool read whole
    # no group kept in full: the full-length tensor is a placeholder that counts the tokens
    # (fixed at a request's prefill for every layer, held by it since; only a layer with no full group writes one)
    width = int(layer.condcomp_placeholder)
    if step.held is None and B:
        width = placeholder_width(layer, B, T, True)
    # the split-K decode kernel, when the config asks, reads the full slots up to the static layer's count
    kernel = bool(getattr(getattr(routed, "condcomp_config", None), "decode_kernel", False))
    weights = call.weights if call.weights is not None else routed.adapter.weights(routed)
    compact = CompactCall(x, call.mask, weights, call.projections, layer, step.query_start, step.held is None, pool,
                          width, call.extra, store, call.rotary, call.sliding_window, call.score_bias,
                          call.relative_bias, kernel)
    return attend_compact(routed, plan, sel, compact)
