"""Every place condcomp relies on transformers' internals rather than its public API, one named function each.

condcomp stores a request's plan with its KV cache, recognises the caches it cannot serve, and refuses
``generate(use_cache=False)`` where the text would change; transformers (checked against
:data:`TRANSFORMERS_CHECKED`) offers no public hook for these, so each contact is here, says what it relies on and
why no public hook serves, and ``tests/integrations/hf/test_internals.py`` fails with a message naming the contact
when a transformers release changes what it relies on. The callers (``cache.py``, ``kv_layer.py``, ``decode.py``,
``generation_check.py``, ``interface.py``) use only these names. condcomp's cache layer (``kv_layer.PlanLayer``)
subclasses transformers' public ``CacheLayerMixin`` and wraps the layer a cache built: no class is swapped.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

TRANSFORMERS_CHECKED = "5.25.0"  # the transformers release every contact below was read against


# Class-level flags of transformers' cache layers that the Cache reads from each layer object (``Cache.is_sliding``,
# ``is_compileable``, ``is_croppable``, ``is_initialized``'s ``supports_early_init``): condcomp's wrapping layer
# (``kv_layer.PlanLayer``) answers each with its wrapped layer's value; every other attribute it reads through.
DELEGATED_LAYER_FLAGS = ("is_compileable", "is_croppable", "supports_early_init", "is_sliding")


def new_layer_factory(cache: Any, wrap: Callable[[Any], Any]) -> None:
    """Make a lazily growing cache (``DynamicCache()`` without a config) build its new layers with ``wrap(factory)``
    instead of its ``layer_class_to_replicate`` ``factory``; a cache built with its layers is left as it is.

    Relies on: ``Cache.update`` appending ``self.layer_class_to_replicate()`` (called with no argument) for a layer
    index it has no layer for yet. No public hook: a ``Cache`` builds its layers itself, and ``adopt`` must reach
    the layers a user's empty cache has not built yet."""
    factory = getattr(cache, "layer_class_to_replicate", None)
    if factory is not None:
        cache.layer_class_to_replicate = wrap(factory)


def build_missing_layers(cache: Any, layer_idx: int) -> None:
    """Build the layers up to ``layer_idx`` a lazily growing cache has not built yet, as its ``update`` would
    (``layer_class_to_replicate()`` appended); a cache built with its layers is left as it is.

    Relies on: the same ``Cache.update`` code as :func:`new_layer_factory`. No public hook: a cache builds a
    layer only inside ``update``, while condcomp's layer must exist before the call writes it (the ``kv_cache``
    executor writes the kept groups through it)."""
    factory = getattr(cache, "layer_class_to_replicate", None)
    while factory is not None and len(cache.layers) <= layer_idx:
        cache.layers.append(factory())


def layer_initialized(layer: Any) -> bool:
    """Whether a cache layer holds (or, static, has allocated) tensors: its ``is_initialized`` attribute.

    Relies on: ``CacheLayerMixin.is_initialized``, set by ``lazy_initialization`` at the first ``update`` and cleared
    by ``reset`` of dynamic layers. No public hook: ``get_seq_length()`` of a static layer reads a tensor (a device
    sync per layer and call) and of an uninitialised layer is 0 for both "empty" and "never allocated"."""
    return bool(getattr(layer, "is_initialized", False))


def reallocate_static_layer(layer: Any) -> None:
    """Make an allocated but empty static cache layer allocate again at its next ``update``: its
    ``lazy_initialization`` then sizes ``(B, heads, max_cache_len, Dh)`` from the states given.

    Relies on: ``StaticLayer.update`` calling ``lazy_initialization`` while ``is_initialized`` is False. No public
    hook: a static layer is allocated once, from its first ``update``'s head count (a cache made with
    ``early_initialization`` from the model's config holds every head), and has no resize method."""
    layer.is_initialized = False


def counts_on_device(layer: Any) -> bool:
    """Whether a cache layer is a (non-sliding) static one, whose token count is the device scalar
    :func:`static_held` reads: it has ``max_cache_len`` and is not ``is_sliding`` (both class-level facts of
    ``StaticLayer`` and ``StaticSlidingWindowLayer``). No public hook: ``Cache`` has no "static" flag."""
    return hasattr(layer, "max_cache_len") and not getattr(layer, "is_sliding", False)


def static_held(layer: Any) -> Any:
    """The tokens a (non-sliding) static cache layer holds as its device scalar, or None for any other layer.

    Relies on: ``StaticLayer.cumulative_length``, the int64 scalar it advances in place at each ``update`` (its
    writes go to ``arange(T) + cumulative_length``) and lowers in place at ``crop``; ``StaticSlidingWindowLayer``
    counts on the host too (``cumulative_length_int``), so it is left out. No public hook: ``get_seq_length()``
    returns the same tensor, but also returns an int for the other layers and 0 before allocation."""
    if not counts_on_device(layer):
        return None
    held = getattr(layer, "cumulative_length", None)
    return held if isinstance(held, torch.Tensor) else None


def host_length(layer: Any) -> int | None:
    """The tokens a layer that counts them on the host holds (``StaticSlidingWindowLayer.cumulative_length_int``),
    or None. Relies on that attribute; no public hook: ``get_seq_length()`` reads its device tensor instead."""
    counted = getattr(layer, "cumulative_length_int", None)
    return counted if isinstance(counted, int) else None


def held_count(layer: Any) -> int | torch.Tensor:
    """The tokens a transformers cache layer holds, read once: the device scalar of an allocated (non-sliding)
    static layer (:func:`static_held`), else an int on the host (:func:`host_length`, or ``get_seq_length()``); 0
    when it holds none (:func:`layer_initialized`). Relies on the contacts of those three; ``layer``: transformers'
    own layer (condcomp's wrapper passes the one it wraps)."""
    if not layer_initialized(layer):
        return 0
    held = static_held(layer)
    if held is not None:
        return held
    counted = host_length(layer)
    return int(layer.get_seq_length()) if counted is None else counted


def is_paged_cache(cache: Any) -> bool:
    """Whether ``cache`` is transformers' continuous-batching ``PagedAttentionCache`` (every request packed into one
    row). Relies on the class name: importing it (``transformers.generation.continuous_batching``) costs an import
    of the whole continuous-batching machinery on every call's first check, and no public attribute marks a paged
    cache."""
    return type(cache).__name__ == "PagedAttentionCache"


def is_static_cache(cache: Any, layer: Any) -> bool:
    """Whether a cache is preallocated (``StaticCache``, ``StaticSlidingWindowLayer``, ...): its layer has
    ``max_cache_len``, or its class name starts with ``Static`` (a cache whose layer does not exist yet). No public
    hook: ``Cache`` has no "static" flag, and its layers are created lazily."""
    return hasattr(layer, "max_cache_len") or type(cache).__name__.startswith("Static")


@functools.cache
def _source(forward: Any) -> str:
    try:
        return inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError):
        return ""


def forward_uses_attention_interface(module_class: type) -> bool:
    """Whether a transformers attention module's ``forward`` calls the attention function registry
    (``AttentionInterface``): its source names ``ALL_ATTENTION_FUNCTIONS``.

    Relies on: the modeling files' ``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` call in each attention module's
    forward (Llama, Qwen2/3, Mistral, Gemma, GPT-2, BERT at the checked release). No public hook: a module does not
    declare whether it dispatches through the registry; the source is the only statement of it."""
    return "ALL_ATTENTION_FUNCTIONS" in _source(module_class.forward)  # type: ignore[attr-defined]


@functools.cache
def generate_code() -> Any:
    """The code object of ``GenerationMixin.generate`` (unwrapped from its decorators), None without transformers."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return None
    return inspect.unwrap(GenerationMixin.generate).__code__


def generate_on_stack(is_owner: Callable[[Any], bool], max_depth: int = 200) -> bool:
    """Whether a ``generate()`` call is on the call stack whose model (its frame's ``self``) satisfies
    ``is_owner``; frames are read from the caller's caller up (the caller is a check; the stack it asks about is
    the one it was called from), at most ``max_depth``.

    Relies on: ``GenerationMixin.generate`` running as a Python frame whose code object is that function's (its
    decorators wrap it, ``inspect.unwrap`` finds it) and whose local ``self`` is the model. No public hook: a
    forward is not told whether ``generate`` called it (``use_cache=False`` forwards look alike)."""
    code, depth = generate_code(), 0
    frame: FrameType | None = sys._getframe(2)  # the caller's caller: the frame the caller's check is about
    while frame is not None and depth < max_depth:
        if frame.f_code is code and is_owner(frame.f_locals.get("self")):
            return True
        frame, depth = frame.f_back, depth + 1
    return False
