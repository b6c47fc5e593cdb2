"""What every transformers adapter shares, in the order a forward uses it: argument binding
(:func:`bind_arguments`), mask reading (:func:`mask_parts`, from :mod:`condcomp.kv.decoder`), every head's keys and
values into the cache (:func:`cache_every_head`, :func:`cross_attention_states`), and the step every forward ends
with (:func:`attend_call`); the class tables and the base adapter (:class:`TransformersAdapter`).

Every family module (:mod:`.bert`, :mod:`.projection`, :mod:`.gpt2`, :mod:`.t5`, :mod:`.plain`) imports these
helpers from here, so the families never import each other.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from condcomp.adapters import AttentionAdapter
from condcomp.kv.decoder import mask_parts as mask_parts  # re-exported: read here by every adapter
from condcomp.kv.decoder import sliding_window_bias as sliding_window_bias
from condcomp.types import HeadPlan

from .cache import RequestStep, held_record, request_plan

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


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


def decoder_request_plan(routed: Any, step: RequestStep, x: Tensor, mask: Any) -> Any:
    """A decoder self-attention call's plan on a KV cache, before the cache grows: the request's plan stored in
    the cache, or one decided now from the call's real tokens (``mask``: transformers' attention mask, or None)."""
    if step.held is not None:
        return step.held.plan
    B, T = x.shape[:2]
    assert isinstance(step.query_start, int)  # a device scalar only with a held plan
    S = mask.shape[-1] if isinstance(mask, Tensor) else step.query_start + T
    query_mask, _, _ = mask_parts(mask, B, T, S, True, step.query_start)
    return request_plan(routed, step, x, query_mask, step.query_start + T, decoder=True)


def visible_keys(k: Tensor, v: Tensor, mask: Any, query_start: int | Tensor, T: int) -> tuple[Tensor, Tensor]:
    """Keys and values ``(B, h, S, Dh)`` the call's queries may see. Without a mask transformers means causal
    attention over the keys up to the last query: a static cache's empty slots after them are dropped."""
    if mask is None and isinstance(query_start, int) and k.shape[2] > query_start + T:
        return k[:, :, :query_start + T], v[:, :, :query_start + T]
    return k, v


@functools.cache
def _signature(module_cls: Any) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(module_cls.forward))


# module class -> its forward's keyword layout; a dict read (not functools.cache) so torch.compile reads it as data
# instead of tracing inspect.signature again at every compile (the eager prefill fills it first)
_LAYOUTS: dict[Any, tuple[dict[str, Any], str | None]] = {}


def _keyword_layout(module_cls: Any) -> tuple[dict[str, Any], str | None]:
    """``(defaults of the named parameters after self, name of **kwargs or None)`` of the original forward."""
    known = _LAYOUTS.get(module_cls)
    if known is None:
        known = _LAYOUTS[module_cls] = _layout_of(module_cls)
    return known


def _layout_of(module_cls: Any) -> tuple[dict[str, Any], str | None]:
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
    hooks on its own attention classes, which a wrapped layer's forward never returns; a caller may also pass
    ``output_attentions`` to the layer itself)."""
    collector = None if torch.compiler.is_compiling() else _output_collector()  # a ContextVar: not traceable
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
    """The base of every transformers adapter: a module is supported when it is one of ``module_types`` *and*
    :meth:`structure_problem` (each family's) finds nothing wrong, under an ``attn_implementation`` condcomp reads;
    the request plan a KV cache holds for the adapter's layer (:meth:`held_record`)."""

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        """What in ``module``'s parameters differs from the family's structure, or None (each family says)."""
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


def cache_every_head(cache: Any, layer_idx: Any, keys: Tensor, values: Tensor, extra: dict[str, Any],
                     mask: Any = None, step: RequestStep | None = None) -> tuple[Tensor, Tensor]:
    """Append a self-attention call's keys and values of every key/value head, ``(B, Hkv, T, Dh)`` each, to the
    layer's cache (the self-attention half of an ``EncoderDecoderCache``); returns the keys and values the call's
    queries see, ``(B, Hkv, S, Dh)`` each (:func:`visible_keys`, when the call opened a ``step``).

    Every head is cached whatever the plan: a head this token skips may be chosen by a later one. ``extra``: the
    call's other keyword arguments, which the cache reads (``cache_position``, ...)."""
    T = keys.shape[2]
    current = getattr(cache, "self_attention_cache", cache)
    keys, values = current.update(keys, values, layer_idx, kwargs=extra)
    if step is not None:
        keys, values = visible_keys(keys, values, mask, step.query_start, T)
    return keys, values


def cross_attention_states(cache: Any, layer_idx: Any, project: Any, extra: dict[str, Any] | None = None
                           ) -> tuple[Any, Any]:
    """Keys and values ``(B, H, S, Dh)`` of a cross-attention layer through its cache: with an
    ``EncoderDecoderCache``, ``project()`` at the first call, read back at the later ones; a cache of one stack has
    them appended at every call, as transformers' own modules do; ``(None, None)`` without a cache. ``extra``: the
    keyword arguments the cache update receives (as the module passes them)."""
    if cache is None:
        return None, None
    options = {} if extra is None else {"kwargs": extra}
    if not hasattr(cache, "cross_attention_cache"):
        k, v = project()
        return cache.update(k, v, layer_idx, **options)  # type: ignore[no-any-return]
    if cache.is_updated.get(layer_idx):
        layer = cache.cross_attention_cache.layers[layer_idx]
        return layer.keys, layer.values
    k, v = project()
    states = cache.cross_attention_cache.update(k, v, layer_idx, **options)
    cache.is_updated[layer_idx] = True
    return states


def attend_call(routed: RoutedAttention, x: Tensor, mask: Any, *, self_attention: bool = True,
                step: RequestStep | None = None, plan: HeadPlan | None = None, decoder: bool = False,
                key: Tensor | None = None, key_states: Tensor | None = None, value_states: Tensor | None = None,
                rotary: tuple[Tensor, Tensor] | None = None, extra_bias: Tensor | None = None) -> Tensor:
    """The step every transformers adapter's forward ends with: transformers' attention ``mask`` -> condcomp's mask
    parts -> the call's plan -> :meth:`~condcomp.RoutedAttention.attend_parts` -> the plan kept in the cache.
    Returns ``(B, T, D)`` for queries ``x (B, T, D)``.

    ``key``: the encoder states ``(B, S, D)`` of a cross-attention call without cached keys; ``key_states`` /
    ``value_states``: the keys and values read from a cache, ``(B, Hkv, S, Dh)``. ``step``: the call's cache step
    (:func:`.cache.open_step`) or None; ``plan``: the plan decided before the cache grew, if any; ``decoder``: the
    layer's plan is a request's (causal self-attention, cross-attention). ``extra_bias``: added to the mask's bias,
    broadcastable to ``(B, H, T, S)`` (T5's position bias, a causal or sliding-window band).
    """
    B, T = x.shape[:2]
    S = key_states.shape[2] if key_states is not None else (x if key is None else key).shape[1]
    query_start = step.query_start if step is not None and self_attention else None
    query_mask, key_mask, bias = mask_parts(mask, B, T, S, self_attention, query_start)
    if extra_bias is not None:
        bias = extra_bias if bias is None else bias + extra_bias  # (B|1, H|1, T, S)
    if plan is None and (step is not None or decoder):
        plan = request_plan(routed, step, x, query_mask, S, decoder)
    y = routed.attend_parts(x, plan, key=key, mask=query_mask, key_mask=key_mask, attn_bias=bias, rotary=rotary,
                            key_states=key_states, value_states=value_states)
    if step is not None and plan is not None:
        step.keep(routed, plan, None)
    return y
