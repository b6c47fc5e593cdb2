"""The decoder sequence every transformers family shares: a decoder self-attention call on a KV cache.

A family (:mod:`.projection` for Llama, Qwen2/3, Mistral, Gemma; :mod:`.gpt2`; :mod:`.t5`'s decoder; :mod:`.bert`
as a decoder) only translates its arguments into a :class:`DecoderCall` (its projections, rotary, extra per-head
score terms such as T5's position bias, the layer's own sliding window) and calls :func:`decoder_attention`, which
reads top-down: open the step (what the cache holds) -> the plan (held, or decided now) -> project, store, attend
and project out on the compact cache (:func:`held_attention`: the executor ``resolve_executor`` picks, ``kv_cache``,
then the KV policy, then the cache layer) -> or, where a request's plan cannot be held (a per-token plan, a plan
decided in training), every head cached and attended with the plan (:func:`every_head_attention`).

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
from condcomp.executors.auto import resolve_executor
from condcomp.executors.cached import CompactKV, Projections
from condcomp.host import LastForward
from condcomp.kv.choose import kv_policy_of
from condcomp.kv.policy import KVPolicy
from condcomp.kv.position_bias import RelativeBias
from condcomp.kv.selection import KVSelection, pad_slots, select_kv
from condcomp.kv.static import written_bias
from condcomp.kv.window import revertible_tail
from condcomp.types import AttentionInputs, HeadPlan

from .cache import RequestStep, cache_layer, compact_layer, offloaded_store, open_step, placeholder_width
from .common import attend_call, cache_every_head, decoder_request_plan, mask_parts, sliding_window_bias
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
                       extra_bias=_score_terms(call, call.x.shape[1], keys.shape[2], None))


def _score_terms(call: DecoderCall, T: int, S: int, bias: Tensor | None) -> Tensor | None:
    """``bias`` (the mask's, or None) plus the layer's own window band (without a mask) and ``score_bias``."""
    if call.mask is None and call.sliding_window is not None and S > call.sliding_window:
        band = sliding_window_bias(T, S, int(call.sliding_window), call.x.device, call.x.dtype)  # (1, 1, T, S)
        bias = band if bias is None else bias + band
    if call.score_bias is not None:
        bias = call.score_bias if bias is None else bias + call.score_bias  # (B|1, H, T, S)
    return bias


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
        refuse_on_static(policy)
    slots = getattr(layer, "num_heads", None) if layer_initialized(layer) else None
    if isinstance(slots, int) and hasattr(layer, "max_cache_len"):  # static: (B, slots, max_len, Dh) allocated
        if selection.slots <= slots:
            return pad_slots(selection, slots)
        reallocate_static_layer(layer)  # an empty static layer too small for this plan: allocated again
    return selection


def refuse_on_static(policy: KVPolicy) -> None:
    """Refuse, by name, a KV policy whose groups a static cache cannot hold: one whose state does not stay a fixed
    number of slots after the prefill (``holds_fixed_slots``), or a window inside the model's own sliding window."""
    if not policy.holds_fixed_slots:
        raise ValueError(f"the KV policy {policy.name!r} keeps the groups a plan does not keep in a state of its own "
                         "that does not hold a fixed number of slots after the prefill, which a static cache cannot "
                         "hold: generate with the default DynamicCache (it then runs eagerly)")
    if getattr(policy, "model_window", None) is not None:
        raise ValueError(f"the KV policy {policy.name!r} on a layer with the model's own sliding window cannot be "
                         "preallocated in a static cache: generate with the default DynamicCache")


def held_attention(routed: RoutedAttention, plan: HeadPlan, sel: KVSelection, call: DecoderCall,
                   step: RequestStep) -> Tensor:
    """One call under a request's plan: ``call.x (B, T, D)`` -> ``(B, T, D)``. Translates the call (mask, cache,
    projections, score terms) into an executor call whose inputs carry the compact cache; the executor is the one
    ``resolve_executor`` picks for it (``kv_cache``) and gives the call's usage record."""
    cache, layer_idx, x, mask = step.cache, step.layer_idx, call.x, call.mask
    L = routed.layout
    B, T, _ = x.shape
    layer = compact_layer(cache, layer_idx)  # condcomp's cache layer: the executor writes the kept groups through it
    store = functools.partial(layer.store, cache_kwargs=call.extra)
    if getattr(cache, "offloading", False):  # transformers prefetches and offloads the layer around its update
        store = functools.partial(offloaded_store, cache, layer_idx, call.extra)
    if B == 0:  # an empty batch: nothing to attend, the cache still learns the call's length
        empty = x.new_zeros(B, 0, T, L.head_dim)
        store(empty, empty)
        return x.new_zeros(B, T, L.d_model)
    query_mask: Tensor | None = None
    key_mask: Tensor | None = None
    bias: Tensor | None
    if isinstance(step.query_start, Tensor) and mask is None:  # a static pool read whole: unwritten keys masked
        S = int(layer.get_max_length())
        bias = written_bias(step.query_start, T, S, x.dtype, call.sliding_window)
        bias = bias if call.score_bias is None else bias + call.score_bias
    else:
        S = call.num_keys(step.query_start)  # keys after this call's update
        query_mask, key_mask, bias = mask_parts(mask, B, T, S, True, step.query_start)
        bias = _score_terms(call, T, S, bias)
    windows = layer.policy_state(sel.policy) if step.held is not None else None
    # no group kept in full: the full-length tensor is a placeholder that counts the tokens
    width = placeholder_width(layer, B, T, step.held is None) if sel.slots == 0 else 1
    visible = S if mask is None and not isinstance(step.query_start, Tensor) else None
    # the split-K decode kernel, when the config asks, reads the full slots up to the static layer's count
    asked = bool(getattr(getattr(routed, "condcomp_config", None), "decode_kernel", False))
    held_after = step.query_start + T if asked and isinstance(step.query_start, Tensor) else None
    compact = CompactKV(sel, store, visible, windows,
                        functools.partial(layer.keep_policy_state, policy=sel.policy), call.projections, width,
                        call.relative_bias, held_after)
    inputs = AttentionInputs(x=x, mask=query_mask, key_mask=key_mask, attn_bias=bias, rotary=call.rotary,
                             dropout_p=L.dropout_p if routed.training else 0.0, kv_cache=compact)
    weights = routed.weights()
    run = resolve_executor(routed.executor, weights, inputs, plan, notices=routed.notices)
    y: Tensor = run(weights, inputs, plan)
    # head_usage reports this call (a decode step's T and keys), not the prefill's
    last = routed.last
    s = last.s if last is not None and tuple(last.s.shape) == (B,) else plan.counts.float() / plan.num_heads
    usage = getattr(run, "usage", None)
    routed.last = (usage(s, plan, query_mask, T, S, kv_policy_of(routed).needs_cache) if callable(usage) else
                   LastForward(s, plan, query_mask, T, S, getattr(run, "name", None), getattr(run, "strategy", None)))
    return y
