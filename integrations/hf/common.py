"""What every transformers adapter shares: class tables, mask reading, argument binding, the base adapter.

Every family module (:mod:`.bert`, :mod:`.projection`, :mod:`.gpt2`, :mod:`.t5`, :mod:`.plain`) imports these
helpers from here, so the families never import each other.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.adapters import AttentionAdapter
from condcomp.masks import check_mask_dtype
from condcomp.versions import tensor_version

from .cache import RequestStep, held_record, request_plan


def import_classes(table: list[tuple[str, str]]) -> tuple[type, ...]:
    """The classes of ``table`` (``(module, class name)`` pairs) that the installed transformers has; the others
    are skipped, so an adapter's ``module_types`` lists what this version can build."""
    found = []
    for module_name, cls_name in table:
        try:
            found.append(getattr(importlib.import_module(module_name), cls_name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def parameter_names(module: nn.Module) -> set[str]:
    """Every parameter name of ``module`` (dotted, as ``named_parameters`` spells it): what structure checks read."""
    return {n for n, _ in module.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# Masks: transformers hands attention modules a 4-D bool (sdpa) or additive float (eager) mask, a 2-D padding
# mask (flash attention) or None. The derived forms are cached for the last mask seen, because every layer of a
# forward receives the same tensor and the reduction below is O(B*T*S).
_LAST_MASK: list[Any] = [None]  # one (mask, key, parts) tuple, replaced whole (safe if threads share the model)


def mask_parts(mask: Any, B: int, T: int, S: int, self_attention: bool, query_start: int | None = None
                ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(query_mask (B,T) | None, key_mask (B,S) | None, attn_bias | None)`` from a transformers attention mask.

    ``query_start``: the mask column of the first query (default ``S - T``: the queries are the last keys; a static
    cache places them after the cached tokens, before its empty slots).
    """
    if mask is None:
        return None, None, None
    q0 = S - T if query_start is None else query_start
    # Keyed by identity and version: a mask edited in place between forwards is derived again.
    key = (T, S, self_attention, q0, tensor_version(mask) if isinstance(mask, Tensor) else None)
    cached = _LAST_MASK[0]
    if cached is not None and cached[0] is mask and cached[1] == key and key[4] is not None:
        return cached[2]  # type: ignore[no-any-return]
    if not isinstance(mask, Tensor):
        raise TypeError(f"condcomp received an attention mask of type {type(mask).__name__} (flex attention's "
                        "BlockMask?); load or set the model with attn_implementation='sdpa' or 'eager'")
    if mask.dim() == 2:  # flash-attention style (B, S) padding mask, 1 = real token
        if tuple(mask.shape) != (B, S):
            raise ValueError(f"2-D attention mask must be (B, S) = {(B, S)}, got {tuple(mask.shape)}")
        key_mask = mask.bool()
        parts: tuple[Tensor | None, ...] = (key_mask[:, q0:q0 + T] if self_attention else None, key_mask, None)
    elif mask.dim() == 4:
        check_mask_dtype(mask, "a 4-D attention_mask")
        if mask.dtype == torch.bool:
            allowed = mask
            bias = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        else:
            # eager masks use the dtype's most negative finite number, not -inf (rows stay finite, as in HF)
            allowed = mask > torch.finfo(mask.dtype).min / 2
            bias = mask
        key_ok = allowed.any(dim=1).any(dim=1).expand(B, S)  # (B, S): a key some query may attend
        query_mask = key_ok[:, q0:q0 + T] if self_attention and 0 <= q0 <= S - T else None
        parts = (query_mask, None, bias)
    else:
        raise ValueError(f"attention mask must be 2-D (B, S) or 4-D (B, 1, T, S), got shape {tuple(mask.shape)}")
    _LAST_MASK[0] = (mask, key, parts)
    return parts  # type: ignore[return-value]


def decoder_request_plan(routed: Any, step: RequestStep, x: Tensor, mask: Any) -> Any:
    """A decoder self-attention call's plan on a KV cache, before the cache grows: the request's plan stored in
    the cache, or one decided now from the call's real tokens (``mask``: transformers' attention mask, or None)."""
    B, T = x.shape[:2]
    S = mask.shape[-1] if isinstance(mask, Tensor) else step.query_start + T
    query_mask, _, _ = mask_parts(mask, B, T, S, True, step.query_start)
    return request_plan(routed, step, x, query_mask, step.query_start + T, decoder=True)


def visible_keys(k: Tensor, v: Tensor, mask: Any, query_start: int, T: int) -> tuple[Tensor, Tensor]:
    """Keys and values ``(B, h, S, Dh)`` the call's queries may see. Without a mask transformers means causal
    attention over the keys up to the last query: a static cache's empty slots after them are dropped."""
    if mask is None and k.shape[2] > query_start + T:
        return k[:, :, :query_start + T], v[:, :, :query_start + T]
    return k, v


def sliding_window_bias(T: int, S: int, window: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Additive ``(1, 1, T, S)`` bias forbidding keys more than ``window`` positions back (bottom-right aligned)."""
    i = torch.arange(T, device=device).unsqueeze(1) + (S - T)
    j = torch.arange(S, device=device).unsqueeze(0)
    return torch.zeros(T, S, device=device, dtype=dtype).masked_fill(j <= i - window, float("-inf"))[None, None]


@functools.cache
def _signature(module_cls: Any) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(module_cls.forward))


@functools.cache
def _keyword_layout(module_cls: Any) -> tuple[dict[str, Any], str | None]:
    """``(defaults of the named parameters after self, name of **kwargs or None)`` of the original forward."""
    params = list(_signature(module_cls).parameters.values())[1:]
    if any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in params):
        return {}, "*"  # not callable by keywords alone: always bind
    defaults = {p.name: p.default for p in params if p.kind is not p.VAR_KEYWORD}
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    return defaults, var_kw


ATTENTIONS_NOT_RETURNED = (
    "output_attentions=True: condcomp-wrapped attention layers return no attention maps (the executors never "
    "materialise them), so `attentions` leaves those layers out (an empty tuple when every layer is wrapped). "
    "For the dense model's maps run that forward inside `with condcomp.disabled(model):`")


@functools.cache
def _output_collector() -> Any:
    """transformers' collector of recorded outputs (``output_attentions`` fills it), or None where it has none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def warn_if_attentions_requested(kwargs: dict[str, Any]) -> None:
    """Warn that attention maps are not returned when the caller asked for them (transformers 5 records them with
    hooks on its own attention classes, which a wrapped layer's forward never returns; older versions passed
    ``output_attentions`` to the layer)."""
    collector = _output_collector()
    collected = collector.get() if collector is not None else None
    if kwargs.get("output_attentions") or (collected and ("attentions" in collected
                                                          or "cross_attentions" in collected)):
        warnings.warn(ATTENTIONS_NOT_RETURNED, UserWarning, stacklevel=4)


def bind_arguments(module_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The original forward's arguments by name (``past_key_values`` is the pre-5.40 name of ``cache``).

    Every module-swap adapter binds its call here first, so this is also where a request for attention maps,
    which wrapped layers do not return, is warned about (:func:`warn_if_attentions_requested`)."""
    warn_if_attentions_requested(kwargs)
    kwargs = dict(kwargs)
    if "past_key_values" in kwargs and "cache" not in kwargs:
        kwargs["cache"] = kwargs.pop("past_key_values")
    defaults, var_kw = _keyword_layout(module_cls)
    if not args and var_kw != "*" and all(d is not inspect.Parameter.empty or n in kwargs for n, d in defaults.items()):
        # transformers calls attention by keyword: a dict merge instead of Signature.bind (~30 us per layer call)
        named = {n: kwargs.pop(n, d) for n, d in defaults.items()}
        if kwargs and var_kw is None:
            raise TypeError(f"{module_cls.__name__}.forward() got unexpected keyword arguments {sorted(kwargs)}")
        named["kwargs"] = kwargs
        return named
    sig = _signature(module_cls)
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop(next(iter(sig.parameters)))  # self
    extra = {}
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            extra = named.pop(name, {})
    named["kwargs"] = extra
    return named


class TransformersAdapter(AttentionAdapter):
    """Shared parts: class + structure matching and the ``attn_implementation`` check."""

    required: set[str] = set()

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return isinstance(module, cls.module_types) if cls.module_types else False

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        raise NotImplementedError

    def held_record(self, cache: Any) -> Any:
        """The request plan stored in ``cache`` for this layer (:mod:`.cache`), or None."""
        layer_idx = getattr(self, "layer_idx", None)
        if layer_idx is None:
            return None
        return held_record(cache, int(layer_idx), self.cross_attention())

    def cross_attention(self) -> bool:
        """Whether the layer reads an encoder's cache (the cross-attention half of an ``EncoderDecoderCache``)."""
        return bool(getattr(self, "cross", False))

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        problem = cls.structure_problem(module)
        if problem is not None:
            return (f"{type(module).__qualname__} does not have the structure condcomp's transformers adapter "
                    f"expects ({problem}); this transformers version may have changed it")
        config = getattr(module, "config", None) or getattr(getattr(module, "self", None), "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and "flex" in str(impl):
            return (f"attn_implementation={impl!r} passes BlockMasks; use 'sdpa' or 'eager' "
                    "(model.set_attn_implementation('sdpa'))")
        return None


def cross_attention_states(cache: Any, layer_idx: Any, project: Any) -> tuple[Any, Any]:
    """Keys and values of a cross-attention layer through an ``EncoderDecoderCache``: ``project()`` once, at the
    first call, then read back (``(None, None)`` without a cache)."""
    if cache is None:
        return None, None
    if cache.is_updated.get(layer_idx):
        layer = cache.cross_attention_cache.layers[layer_idx]
        return layer.keys, layer.values
    k, v = project()
    states = cache.cross_attention_cache.update(k, v, layer_idx)
    cache.is_updated[layer_idx] = True
    return states
