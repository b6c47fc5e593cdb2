"""A request's plan lives in its KV cache: stored with each cache layer, so cache operations act on it too.

At inference a decoder's sequence plan belongs to a request: decided at the request's first call on an empty cache
(its prefill) and kept while the cache holds tokens. The plan is stored *with the cached tensors*: the cache's layer
object becomes condcomp's own cache layer (:class:`~.kv_layer.PlanLayer`, a transformers ``CacheLayerMixin`` wrapping
the layer the cache built, which keeps storing and quantizing the keys) holding a
:class:`~condcomp.kv.selection.HeldPlan` with one row per cache row. transformers' cache operations then act on the
plan as on the keys and values:

- ``reset()`` drops it (the next call is a new request's prefill); ``crop(n)`` keeps it while tokens remain;
- ``reorder_cache`` (beam search), ``batch_select_indices`` and ``batch_repeat_interleave`` select or repeat its rows;
- ``copy.deepcopy`` and ``pickle`` carry it (a prefix cache continues with the prefix's plan);
- a cache layer that holds tokens but no plan (filled by a model without condcomp, or under ``condcomp.disabled``)
  is recognised from its data and refused by layers that need a plan; a call that writes every key/value head into
  a cache holding only a plan's kept groups (``condcomp.disabled``, the unwrapped model) is refused by the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from condcomp.host import detached
from condcomp.kv.choose import check_token_plan
from condcomp.kv.policy import KVPolicy
from condcomp.kv.selection import HeldPlan, KVSelection, decision_mask
from condcomp.types import HeadPlan

from .generation_check import check_cache_free_generation
from .internals import build_missing_layers, held_count, is_paged_cache
from .kv_layer import (
    PlanCarrier,
    PlanLayer,
    adopt_layer,
    compact_write,
    is_carrier,
    layer_length,
    layer_tensors,
    window_codec,
)


def placeholder_width(layer: Any, rows: int, tokens: int, prefill: bool) -> int:
    """The width of the token-counting placeholder a layer holding no full group stores, fixed at the request's
    prefill of ``rows x tokens`` (and kept with the layer for its later calls): 1, or, where a layer that quantizes
    in groups of ``n`` values (HQQ, quanto) could not quantize ``rows x tokens`` values, ``n`` (whole groups at any
    length; HQQ would raise a bare AssertionError)."""
    if layer is None:
        return 1
    if not prefill:
        return int(getattr(layer, "condcomp_placeholder", 1))
    group = int(getattr(layer, "q_group_size", 1) or 1)
    width = 1 if (rows * tokens) % group == 0 else group
    layer.condcomp_placeholder = width  # on the layer that holds the plan (a raw layer's is read through a wrapper)
    return width


def stored_windows(layer: Any, policy: KVPolicy | None = None) -> Any:
    """The state of the KV policy's groups a cache layer holds, as the executor reads it (a window dequantized if
    stored so); ``policy``: the policy that stored it (default: the layer's held plan's). A layer that is not
    condcomp's holds none."""
    return layer.policy_state(policy) if is_carrier(layer) else None


def store_windows(layer: Any, windows: Any, policy: KVPolicy | None = None) -> None:
    """Keep the state ``windows`` of ``policy`` (default: the layer's held plan's) in condcomp's cache ``layer``,
    as the policy stores it there (:meth:`~condcomp.kv.layer.CompactLayer.keep_policy_state`)."""
    layer.keep_policy_state(windows, policy)


def cache_layer(cache: Any, layer_idx: int, cross: bool = False) -> Any:
    """The layer object of ``cache`` holding layer ``layer_idx`` (the cross-attention half of an
    ``EncoderDecoderCache`` when ``cross``), or None when it does not exist yet."""
    if hasattr(cache, "self_attention_cache"):
        cache = cache.cross_attention_cache if cross else cache.self_attention_cache
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    return layers[layer_idx]


def plan_layer(cache: Any, layer_idx: int, cross: bool = False) -> PlanLayer:
    """Layer ``layer_idx`` of ``cache`` as condcomp's cache layer, the cache's own layer wrapped in place the first
    time (:func:`condcomp.kv.adopt` does every layer at once); it must exist (a lazy cache builds it at its first
    ``update``)."""
    if cache_layer(cache, layer_idx, cross) is None:
        raise RuntimeError(f"layer {layer_idx}: the KV cache has no layer {layer_idx} (it has "
                           f"{len(getattr(cache, 'layers', []))}): it was built for another model")
    half = getattr(cache, "cross_attention_cache" if cross else "self_attention_cache", cache)
    return adopt_layer(half.layers, layer_idx)


def compact_layer(cache: Any, layer_idx: int) -> PlanLayer:
    """Layer ``layer_idx`` of ``cache`` as condcomp's cache layer before a compact call writes it: built now by a
    lazily growing cache (as its ``update`` would), and wrapped in place the first time."""
    build_missing_layers(cache, layer_idx)
    return plan_layer(cache, layer_idx)


def offloaded_store(cache: Any, layer_idx: int, cache_kwargs: Any, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The kept groups appended through an offloading cache's own ``update`` (it prefetches the layer before and
    offloads it after); any other cache is written through condcomp's layer directly."""
    with compact_write():
        return cache.update(k, v, layer_idx, kwargs=cache_kwargs)  # type: ignore[no-any-return]


def held_record(cache: Any, layer_idx: int, cross: bool = False) -> HeldPlan | None:
    """The plan stored with layer ``layer_idx`` of ``cache``, or None."""
    layer = cache_layer(cache, layer_idx, cross) if cache is not None else None
    if layer is None or layer_length(layer) == 0:
        return None
    return getattr(layer, "condcomp_plan", None)


@dataclass(frozen=True)
class RequestStep:
    """One call of a wrapped decoder layer on a KV cache: where the request's plan lives and what the cache held."""

    cache: Any
    layer_idx: int
    cross: bool
    # tokens this layer held before the call; None: a static layer holding a request's compact cache, whose count
    # stays on the device (query_start is then that device scalar: a compiled step reads no host counter)
    past: int | None
    query_start: int | Tensor  # the attention mask's column of this call's first query
    held: HeldPlan | None  # the request's plan, when the cache holds one
    after_prompt: int = 0  # a first call's tokens after the prompt (plan_from_prompt): revertible_tail keeps them
    layer: PlanLayer | None = None  # condcomp's cache layer, when it holds the request's compact cache

    def keep(self, routed: Any, plan: HeadPlan, selection: KVSelection | None) -> None:
        """Store a plan decided now with the cache layer (after the call's update created it)."""
        if self.held is not None or plan.granularity != "sequence":
            return
        layer = plan_layer(self.cache, self.layer_idx, self.cross)
        layer.condcomp_plan = HeldPlan(detached(plan), selection, routed.layout.num_kv_heads)

    def no_plan_error(self) -> ValueError:
        return ValueError(
            f"layer {self.layer_idx}: the KV cache already holds {self.past} token(s) but no condcomp plan (it was "
            "filled by a model without condcomp routing, under condcomp.disabled, or rebuilt from its tensors); "
            "condcomp did not decide a plan for it. A request's plan is decided at its first call on an empty cache "
            "and stored in the cache: start the request with a fresh cache on the wrapped model")


def open_step(routed: Any, cache: Any, layer_idx: int, B: int, T: int, cross: bool = False) -> RequestStep:
    """Read, before the call updates it, what ``cache`` holds for this layer; a held plan is checked against the
    layer's layout and the call's batch (a cache of another model or batch is refused by its data). Each fact is
    read once, from transformers' own layer (``inner`` of condcomp's), so the step goes down from here."""
    layer = cache_layer(cache, layer_idx, cross)
    held = getattr(layer, "condcomp_plan", None)
    if held is None and is_paged_cache(cache):  # (a cache holding a plan was adopted, which refuses paged caches)
        raise ValueError("condcomp does not support transformers' continuous batching (generate_batch, a "
                         "PagedAttentionCache): it packs every request into one row, while a request's plan needs "
                         "a cache row of its own; use generate() with a batch of requests")
    inner = getattr(layer, "inner", layer)  # transformers' layer (condcomp's PlanLayer wraps it)
    count = held_count(inner)
    past: int | None
    query_start: int | Tensor
    compact = not cross and held is not None and held.selection is not None and isinstance(layer, PlanLayer)
    if compact and isinstance(count, Tensor):  # a static layer holding a request's compact cache: its count stays
        past, query_start = None, count.clone()  # on the device (the write advances the layer's own scalar in place)
    else:
        past = int(count)
        query_start = past
        if past and not cross and hasattr(inner, "get_mask_sizes"):
            query_start = past - int(inner.get_mask_sizes(T)[1])  # sliding layers: the mask starts at an offset
        held = held if past else None
    if held is not None:  # a cache of another model or batch is refused by the plan it holds
        keys = getattr(inner, "keys", None)
        held.check(layer_idx, routed.adapter.layout, B,
                   int(keys.shape[1]) if isinstance(keys, Tensor) and keys.dim() == 4 else None)
    prompt_len = getattr(routed, "prompt_len", None)
    after_prompt = T - prompt_len if past == 0 and prompt_len is not None and T > prompt_len else 0
    return RequestStep(cache, layer_idx, cross, past, query_start, held, after_prompt,
                       layer if compact and held is not None else None)


PREFILL_COMPILED = (
    "condcomp: a request's first call on a KV cache (its prefill, or a chunked prefill's first chunk) decides its "
    "plan and sizes its compact cache on the host, so it cannot run inside torch.compile. Prefill eagerly and compile "
    "the decode steps: generate(..., compile_config=...) does so unless prefill_chunk_size is set (it compiles every "
    "prefill chunk: drop prefill_chunk_size or the compile_config); calling a torch.compile'd model yourself, run "
    "the prefill through the model itself")


def request_plan(routed: Any, step: RequestStep | None, x: Tensor, query_mask: Tensor | None, num_keys: int,
                 decoder: bool) -> HeadPlan:
    """The call's plan: the request's held plan, or one decided now (a sequence plan only on an empty cache).
    ``decoder``: the layer is a decoder's (causal self-attention or cross-attention), whose plan is a request's."""
    if step is not None and step.held is not None:
        return step.held.plan
    plan: HeadPlan = routed.route(x, query_mask, routed.weights(), num_keys)
    if step is not None and step.past != 0 and plan.granularity == "sequence":
        raise step.no_plan_error()
    if step is not None and decoder and plan.granularity == "sequence" and torch.compiler.is_compiling():
        raise ValueError(PREFILL_COMPILED)  # (torch.compile reports it as the exception it observed)
    B, T = x.shape[:2]  # the plan is decided from the call's real tokens (the prompt's, under plan_from_prompt)
    real = None if query_mask is None else decision_mask(query_mask, routed.prompt_len, B, T, x.device)
    if step is not None and plan.granularity == "sequence" and real is not None and real.shape[1] and (
            not bool(real.any(-1).all())):  # one host sync, at a request's first call only
        raise ValueError(
            f"layer {step.layer_idx}: a request's plan is decided at its first call, and row(s) "
            f"{(~real.any(-1)).nonzero().flatten().tolist()} hold no real (prompt) token: their plan would be decided "
            "from nothing. With chunked prefill (generate(prefill_chunk_size=n)) use a chunk longer than the longest "
            "padding, or prefill in one call; drop empty prompts from the batch")
    if step is None and decoder and plan.granularity == "sequence":
        check_cache_free_generation(routed, plan)
    if step is not None and decoder:
        check_token_plan(routed, plan)  # a per-token plan caches every head: no KV policy can apply
    return plan


def _tensor_bytes(value: Any, seen: set[int]) -> int:
    """Bytes of the memory the tensors in ``value`` (a tensor or a container of them) keep alive: each storage once
    and whole (a view cut by ``crop`` or a sliding layer keeps the storage it was cut from); a tensor whose storage
    cannot be read (a wrapper subclass) counts its elements."""
    if isinstance(value, Tensor):
        if not value.numel():
            return 0
        try:
            storage = value.untyped_storage()
            key, nbytes = storage.data_ptr(), int(storage.nbytes())
        except (RuntimeError, NotImplementedError, TypeError):
            key, nbytes = id(value), value.numel() * value.element_size()
        if key in seen:
            return 0
        seen.add(key)
        return nbytes
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, seen) for v in value.values())
    return 0


def cache_bytes(cache: Any) -> list[int]:
    """The bytes each layer of a transformers KV cache holds in tensors: keys and values (quantized ones and their
    scales too, for a quantized cache) and condcomp's streamed-group windows; the plan itself (a few bytes per
    request and head) is not counted. ``sum(cache_bytes(c)) / sum(cache_bytes(dense))`` is the measured KV fraction.

    It counts the memory held, each distinct storage once and whole: after ``cache.crop(n)`` (until the next update)
    and in a sliding-window layer, a view counts as the storage it was cut from (freed only later). An
    encoder-decoder cache (T5's ``EncoderDecoderCache``) counts both halves: layer ``i`` holds its self-attention
    keys and values and its cross-attention ones (a storage both share counted once).

    >>> import torch, transformers  # doctest: +SKIP
    >>> cache = transformers.DynamicCache()  # doctest: +SKIP
    >>> _ = cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)  # doctest: +SKIP
    >>> cache_bytes(cache)  # doctest: +SKIP
    [320]
    """
    halves = [getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)]
    if halves[0] is None:
        halves = [cache]
    per_half = [_cache_layers(half) for half in halves if half is not None]
    out = []
    for i in range(max(len(layers) for layers in per_half)):
        seen: set[int] = set()  # per layer: the halves of one layer may share a storage, layers do not
        out.append(sum(_tensor_bytes(v, seen) for layers in per_half if i < len(layers)
                       for v in layer_tensors(layers[i])))
    return out


def _cache_layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cache_bytes: expected a transformers KV cache (with .layers), got {type(cache).__name__}")
    return list(layers)


__all__ = ["PlanCarrier", "RequestStep", "cache_bytes", "cache_layer", "compact_layer", "compact_write", "held_record",
           "is_carrier", "offloaded_store", "open_step", "placeholder_width", "plan_layer", "request_plan",
           "store_windows", "stored_windows", "window_codec"]
