"""condcomp's own transformers cache layer: it wraps the layer transformers built and holds a request's plan.

A :class:`PlanLayer` is a ``CacheLayerMixin`` (transformers' public cache-layer base) that holds the layer a
``Cache`` built (``DynamicLayer``, a quantized layer for fp8/HQQ/quanto, a static layer, ...) and hands it the
storage and quantization of the kept groups' keys and values. Beside it, it holds what condcomp keeps per request:

- ``condcomp_plan``: the :class:`~condcomp.kv.selection.HeldPlan` (one row per cache row);
- ``condcomp_windows``: the state of the groups the plan's KV policy holds (a streaming window, SnapKV's tokens),
  stored as the policy stores it in this layer (quantized inside a quantized layer, :func:`window_codec`);
- ``condcomp_placeholder`` (the width of the token-counting placeholder of a layer that holds no full group).

A static layer (transformers' ``StaticLayer``) counts its tokens in a device scalar, which a decode step reads
and advances on the device (:mod:`condcomp.kv.static`): such a layer says ``is_compileable``, and a compiled
decode step of a wrapped model reads no host counter. There the KV policy's state is allocated once at the prefill
too, sized by the room the static layer has left (:meth:`PlanLayer.fixed_slot_room`, :mod:`condcomp.kv.fixed_slots`).

Every cache operation transformers offers acts on both: ``reset()`` drops the plan (the next call is a new request's
prefill), ``crop(n)`` keeps it while tokens remain, ``reorder_cache`` (beams), ``batch_select_indices`` and
``batch_repeat_interleave`` select or repeat its rows, and ``copy.deepcopy`` / ``pickle`` carry it. What the
``Cache`` and generation read from a layer directly (``keys``, ``values``, ``is_initialized``, ``is_sliding``,
``get_mask_sizes``, ...) is the wrapped layer's. :func:`adopt` installs it on a cache (its ``layers`` entries
replaced by wrappers); a wrapped model does so itself at a request's first cached call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from transformers import cache_utils
from transformers.cache_utils import CacheLayerMixin

from condcomp.kv.layer import CompactLayer, compact_write, held_policy
from condcomp.kv.window_quant import WindowCodec

from .internals import counts_on_device, held_count, is_paged_cache, new_layer_factory

_OWN = ("inner", "condcomp_")  # attribute names a PlanLayer keeps itself; every other one is the wrapped layer's


def layer_length(layer: Any) -> int:
    """Tokens a cache layer holds (0 when it holds none): on the host. A static layer's count is a device scalar,
    read here with a device sync: a decode step on a request's compact cache reads :func:`device_length` instead."""
    return int(held_count(layer.inner if isinstance(layer, PlanLayer) else layer))


def device_length(layer: Any) -> Tensor | None:
    """The tokens a static cache layer holds as a device scalar (advanced in place by each write), or None for a
    layer that holds none allocated or counts on the host."""
    held = held_count(layer.inner if isinstance(layer, PlanLayer) else layer)
    return held if isinstance(held, Tensor) else None


class PlanLayer(CompactLayer, CacheLayerMixin):
    """A transformers cache layer of condcomp's: the wrapped layer ``inner`` stores the keys and values; the plan
    and the KV policy's state ride beside them through every cache operation (the operations of
    :class:`~condcomp.kv.layer.CompactLayer`; see the module docstring)."""

    def __init__(self, inner: Any) -> None:  # CacheLayerMixin.__init__ is not run: its fields are inner's
        if isinstance(inner, PlanLayer) or not isinstance(inner, CacheLayerMixin):
            raise TypeError(f"PlanLayer wraps a transformers cache layer (a CacheLayerMixin), not "
                            f"{type(inner).__name__}")
        self.__dict__["inner"] = inner
        self._resolve()

    def _resolve(self) -> None:
        # what a decode step reads as data, resolved once from the wrapped layer's class and settings
        inner = self.__dict__["inner"]
        self.__dict__["condcomp_codec"] = window_codec(inner)
        self.__dict__["condcomp_preallocated"] = counts_on_device(inner)

    def __setstate__(self, state: dict[str, Any]) -> None:  # a layer pickled before these were resolved gets them
        self.__dict__.update(state)
        if "inner" in state:
            self._resolve()

    # ---- the wrapped layer's data and flags, read and written through ------------------------------------------
    def __getattr__(self, name: str) -> Any:  # only for names not found on the wrapper itself
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):  # half-built (unpickling, deepcopy): no delegation yet
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith(_OWN):
            self.__dict__[name] = value
        else:
            setattr(self.__dict__["inner"], name, value)

    def __delattr__(self, name: str) -> None:
        if name.startswith(_OWN):
            del self.__dict__[name]
        else:
            delattr(self.__dict__["inner"], name)

    def __repr__(self) -> str:
        return f"PlanLayer({self.inner!r})"

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return bool(self.inner.is_compileable)

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return bool(self.inner.is_croppable)

    @property
    def supports_early_init(self) -> bool:  # type: ignore[override]
        return bool(self.inner.supports_early_init)

    @property
    def is_sliding(self) -> bool:
        return bool(getattr(self.inner, "is_sliding", False))

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.inner.lazy_initialization(key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)  # type: ignore[no-any-return]

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()  # type: ignore[no-any-return]

    def get_max_length(self) -> int:
        return self.inner.get_max_length()  # type: ignore[no-any-return]

    def offload(self) -> None:
        self.inner.offload()

    def prefetch(self) -> None:
        self.inner.prefetch()

    # ---- what CompactLayer asks of the library's layer -----------------------------------------------------------
    def held_tokens(self) -> int:
        return int(held_count(self.inner))

    def held_position(self) -> Tensor | None:
        held = held_count(self.inner)
        return held if isinstance(held, Tensor) else None

    def fixed_slot_room(self) -> int | None:
        if self.held_position() is None:
            return None
        return int(self.inner.get_max_length()) - self.held_tokens()


PlanCarrier = PlanLayer  # the name of the class-swapped carrier before 0.3: kept for code that checks isinstance


def is_carrier(layer: Any) -> bool:
    """Whether a cache layer is condcomp's (can carry a request's plan)."""
    return isinstance(layer, PlanLayer)


@dataclass(frozen=True)
class NewPlanLayer:
    """What a lazily growing cache (``DynamicCache()``) builds for a new layer once adopted: its own layer class,
    wrapped. A plain class (not a closure), so an adopted cache pickles."""

    layer_class: Any

    def __call__(self) -> PlanLayer:
        return PlanLayer(self.layer_class())


def _refused_layer(layer: Any) -> str | None:
    if isinstance(layer, PlanLayer) or isinstance(layer, cache_utils.DummyLayer):
        return None
    linear: Any = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
    if isinstance(layer, linear):
        return (None if not isinstance(layer, CacheLayerMixin) else
                f"{type(layer).__name__} holds linear-attention states beside its keys, which condcomp's cache layer "
                "cannot stand in for")
    if not isinstance(layer, CacheLayerMixin):
        return f"{type(layer).__name__} is not a transformers cache layer (CacheLayerMixin)"
    return None


def adopt_layer(layers: list[Any], index: int) -> PlanLayer:
    """The layer at ``layers[index]`` as condcomp's (wrapped in place, once)."""
    layer = layers[index]
    if isinstance(layer, PlanLayer):
        return layer
    reason = _refused_layer(layer) or (None if isinstance(layer, CacheLayerMixin) else "it holds no keys and values")
    if reason is not None:
        raise ValueError(f"condcomp cannot hold a request's plan in KV cache layer {index}: {reason}")
    wrapped = PlanLayer(layer)
    layers[index] = wrapped
    return wrapped


def adopt(cache: Any) -> Any:
    """Install condcomp's cache layer on ``cache`` (a transformers ``Cache`` a user builds: ``DynamicCache``,
    ``QuantizedCache``, ``StaticCache``, an ``EncoderDecoderCache``'s two halves) and return it.

    Each entry of ``cache.layers`` is replaced by a :class:`PlanLayer` wrapping it (the layer keeps storing and
    quantizing the keys), and a cache that grows its layers lazily builds wrapped ones. A wrapped model does this
    itself at a request's first cached call; call it to hold condcomp's layers before (to pickle or copy an empty
    cache, or to see the layers it will use). Calling it again changes nothing. Refused: transformers' continuous
    batching cache (``PagedAttentionCache``) and layers that are not attention cache layers.

    >>> import transformers, condcomp  # doctest: +SKIP
    >>> cache = condcomp.kv.adopt(transformers.DynamicCache(config=model.config))  # doctest: +SKIP
    >>> out = model.generate(**inputs, past_key_values=cache)  # doctest: +SKIP
    """
    if is_paged_cache(cache):
        raise ValueError("condcomp.kv.adopt: a PagedAttentionCache (continuous batching) packs every request into one "
                         "row, while a request's plan needs a cache row of its own; use generate() with a batch of "
                         "requests and a DynamicCache / QuantizedCache / StaticCache")
    if hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache: self- and cross-attention both hold plans
        adopt(cache.self_attention_cache)
        adopt(cache.cross_attention_cache)
        return cache
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise TypeError(f"condcomp.kv.adopt: expected a transformers Cache (with a list of layers), got "
                        f"{type(cache).__name__}")
    problems = [f"layer {i}: {r}" for i, layer in enumerate(layers) if (r := _refused_layer(layer)) is not None]
    if problems:
        raise ValueError("condcomp.kv.adopt: " + "; ".join(problems))
    for i, layer in enumerate(layers):
        if isinstance(layer, CacheLayerMixin) and not isinstance(layer, PlanLayer):
            layers[i] = PlanLayer(layer)
    new_layer_factory(cache, lambda cls: cls if isinstance(cls, NewPlanLayer) else NewPlanLayer(cls))
    return cache


def window_codec(layer: Any) -> WindowCodec | None:
    """How a quantized transformers cache layer stores the streamed groups' windows it holds, as it stores its own
    keys: fp8 for an ``Fp8QuantizedLayer``, the layer's ``nbits`` and ``q_group_size`` for a ``QuantizedLayer``
    (HQQ, quanto); None (full precision) for any other layer. ``layer``: a wrapped layer is read through."""
    inner = layer.inner if isinstance(layer, PlanLayer) else layer
    fp8: Any = getattr(cache_utils, "Fp8QuantizedLayer", ())  # () where this transformers has no such layer
    grouped: Any = getattr(cache_utils, "QuantizedLayer", ())
    if isinstance(inner, fp8):
        return WindowCodec("fp8")
    if isinstance(inner, grouped):
        return WindowCodec("int", nbits=int(inner.nbits), group=int(inner.q_group_size))
    return None


def layer_tensors(layer: Any) -> list[Any]:
    """What a cache layer holds, for counting its bytes: the wrapped layer's fields and condcomp's own (the KV
    policy's state as the policy lists its tensors); the plan itself is left out."""
    own = layer.__dict__ if isinstance(layer, PlanLayer) else {}
    inner = layer.inner if isinstance(layer, PlanLayer) else layer
    skip = ("inner", "condcomp_plan", "condcomp_windows")
    out = [v for k, v in [*vars(inner).items(), *own.items()] if k not in skip]
    windows = own.get("condcomp_windows")
    if windows is not None:  # the KV policy counts its own state
        policy = held_policy(layer)
        if policy is None:
            raise ValueError("cache_bytes: a cache layer holds a KV policy's state but no plan saying whose")
        out.append(policy.tensors(windows))
    return out


__all__ = ["NewPlanLayer", "PlanCarrier", "PlanLayer", "adopt", "adopt_layer", "compact_write", "device_length",
           "held_policy", "is_carrier", "layer_length", "layer_tensors", "window_codec"]
