"""The base decoder sequence on a request's compact cache: one call, in plain tensors, down one way.

An adapter (``condcomp.integrations.hf`` for transformers) translates its library's call once, at the top, into a
:class:`CompactCall`: the queries' input, the library's attention mask as a tensor, the layer's weights and
projections, where the call's queries start, and the cache layer (a :class:`StepLayer`: condcomp's
:class:`~condcomp.kv.layer.CompactLayer`). :func:`attend_compact` then reads down and never back up: the mask parts
and score terms (:func:`mask_parts`) -> the executor ``resolve_executor`` picks at the request's first call
(``kv_cache``, held by the cache layer for the later calls, each run and recorded in one call: ``attend``) -> the KV
policy of the groups the plan does not keep, which reads and keeps its state in the cache layer in the same call
(:meth:`~condcomp.kv.policy.KVPolicy.attend_in`) -> the cache layer, whose ``store`` writes the kept groups' keys and
values and hands back their history. What a call needs to know of the policy (whether it holds the unkept groups,
its name, the keys a streamed head reads) is data of the request's :class:`~condcomp.kv.selection.KVSelection`,
decided at its first call: nothing here asks the policy. Nothing here imports transformers or calls into an
adapter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from condcomp.executors.auto import resolve_executor
from condcomp.executors.cached import CompactKV
from condcomp.host import LastForward
from condcomp.kv.position_bias import RelativeBias
from condcomp.kv.selection import KVSelection
from condcomp.kv.static import query_rows, written_bias
from condcomp.masks import additive_bias, attended_keys, check_mask_dtype
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan, Projections
from condcomp.versions import tensor_version


class StepLayer(Protocol):
    """What a call asks of the cache layer it writes (:class:`~condcomp.kv.layer.CompactLayer` has it all): the
    kept groups' writer, and the KV policy's state as data (read and kept by the policy,
    :meth:`~condcomp.kv.policy.KVPolicy.attend_in`). Optional: ``hold_executor(executor)`` and
    ``condcomp_executor``, to hold the executor a request's first call resolved for its later calls (a layer
    without them has the executor resolved at every call)."""

    condcomp_windows: Any  # the policy's state as the policy stores it here
    condcomp_codec: Any  # how the policy's state is stored here (a WindowCodec), or None: full precision
    condcomp_preallocated: bool | None  # False: the storage grows (None: ask fixed_slot_room)

    def store(self, k: Tensor, v: Tensor, cache_kwargs: Any = None) -> tuple[Tensor, Tensor]:
        """Append the kept groups' ``(B, g, T, Dh)``; their whole history ``(B, g, S, Dh)``."""
        ...

    def hold_state(self, stored: Any) -> None:
        """Hold the policy's state (as stored)."""
        ...

    def fixed_slot_room(self) -> int | None:
        """Tokens preallocated storage can still take, or None where it grows."""
        ...


@dataclass(frozen=True)
class CompactCall:
    """One call of a request on its compact cache, translated by the adapter.

    - ``x (B, T, D)``: the queries' input; ``mask``: the library's attention mask, a 2-D ``(B, S)`` padding mask or
      a 4-D ``(B, 1, T, S)`` bool or additive one (read by :func:`mask_parts`), or None (causal over every key).
    - ``weights``: the layer's canonical weights (their layout sizes the call; executors read them);
      ``projections``: the layer's q/k/v/o as the module runs them (exact for LoRA).
    - ``layer``: the cache layer the kept groups are written to; ``store``: a different writer of the same layer
      (an offloading cache's own update), or None.
    - ``query_start``: the mask column of the call's first query: an int, or a device scalar (preallocated storage
      whose count stays on the device); ``pool_length``: the keys of such storage, read whole when there is no mask.
    - ``prefill``: the request's first call (its plan decided now: no KV policy state to read yet).
    - ``placeholder_width``: the width of the token-counting placeholder a layer with no full group stores.
    - ``cache_kwargs``: the library's cache arguments the layer reads (``cache_position``, ...).
    - ``rotary``: ``(cos, sin)``, each ``(B, T, Dh)``; ``sliding_window``: the layer's own window; ``score_bias``: a
      per-head ``(B|1, H, T, S)`` term added to the scores; ``relative_bias``: the same as a function of distance,
      added by the KV policy's groups at their keys' true positions; ``decode_kernel``: the split-K decode kernel
      is asked for (``CondCompConfig.decode_kernel``).
    """

    x: Tensor
    mask: Tensor | None
    weights: AttentionWeights
    projections: Projections
    layer: StepLayer
    query_start: int | Tensor
    prefill: bool
    pool_length: int | None = None
    placeholder_width: int = 1
    cache_kwargs: Any = None
    store: Any = None
    rotary: tuple[Tensor, Tensor] | None = None
    sliding_window: int | None = None
    score_bias: Tensor | None = None
    relative_bias: RelativeBias | None = None
    decode_kernel: bool = False

    def num_keys(self) -> int:
        """Keys the queries see after this call's write (a static pool read whole without a mask: its length)."""
        if isinstance(self.mask, Tensor):
            return int(self.mask.shape[-1])
        if isinstance(self.query_start, Tensor):
            assert self.pool_length is not None, "a device query_start without a mask needs the pool's length"
            return self.pool_length
        return self.query_start + self.x.shape[1]


def attend_compact(host: Any, plan: HeadPlan, sel: KVSelection, call: CompactCall) -> Tensor:
    """One call under a request's plan on its compact cache: ``call.x (B, T, D)`` -> ``(B, T, D)``.

    ``host``: the wrapped layer (its ``executor`` name, ``condcomp_notices``, ``training``; its ``last`` record is
    set to this call's usage, which ``head_usage`` reports); ``sel``: the plan's slots. The executor is the one
    ``resolve_executor`` picks for a call that carries a compact cache (``kv_cache``) at the request's first call,
    held by the cache layer (:meth:`~condcomp.kv.layer.CompactLayer.hold_executor`) for its later calls."""
    x, mask, L = call.x, call.mask, call.weights.layout
    B, T, _ = x.shape
    store = call.store if call.store is not None else functools.partial(call.layer.store,
                                                                          cache_kwargs=call.cache_kwargs)
    if B == 0:  # an empty batch: nothing to attend, the cache still learns the call's length
        empty = x.new_zeros(B, 0, T, L.head_dim)
        store(empty, empty)
        return x.new_zeros(B, T, L.d_model)
    on_device = isinstance(call.query_start, Tensor)
    S = call.num_keys()
    query_mask: Tensor | None = None
    key_mask: Tensor | None = None
    bias: Tensor | None
    if on_device and mask is None:  # a static pool read whole: unwritten keys masked
        assert isinstance(call.query_start, Tensor)
        bias = written_bias(call.query_start, T, S, x.dtype, call.sliding_window)
        bias = bias if call.score_bias is None else bias + call.score_bias
    else:
        query_mask, key_mask, bias = mask_parts(mask, B, T, S, True, call.query_start)
        bias = score_terms(call, T, S, bias)
    # The executor is resolved at the request's first call and held by the cache layer, with the plan, for the later
    # calls: a decode step enters it once, for the call and its usage record (``attend``), and it hands the KV
    # policy the cache layer, where the policy reads and keeps its state in the same call (``attend_in``). An
    # executor resolved now (the first call; one without ``attend``, the older protocol, at every call) is given the
    # policy's state before the call and how to keep the new one (``windows``, ``keep_windows``).
    held = None if call.prefill else getattr(call.layer, "condcomp_executor", None)
    policy = sel.policy
    in_layer = held is not None and policy is not None
    windows = None if call.prefill or policy is None or in_layer else policy.state_in(call.layer)
    keep = None if policy is None or in_layer else functools.partial(policy.keep_in, call.layer)
    held_after = call.query_start + T if call.decode_kernel and isinstance(call.query_start, Tensor) else None
    compact = CompactKV(sel, store, S if mask is None and not on_device else None, windows, keep, call.projections,
                        call.placeholder_width, call.relative_bias, held_after, call.layer if in_layer else None,
                        S if in_layer else None)
    inputs = AttentionInputs(x=x, mask=query_mask, key_mask=key_mask, attn_bias=bias, rotary=call.rotary,
                             dropout_p=L.dropout_p if host.training else 0.0, kv_cache=compact)
    run = held
    if run is None:
        run = resolve_executor(host.executor, call.weights, inputs, plan, notices=host.condcomp_notices)
        hold = getattr(call.layer, "hold_executor", None)
        if call.prefill and callable(hold):
            executor = getattr(run, "executor", run)  # a prepared run's executor (kv_cache's CachedRun), or the run
            hold(executor if callable(getattr(executor, "attend", None)) else None)
    # head_usage reports this call (a decode step's T and keys), not the prefill's
    last = host.last
    s = last.s if last is not None and tuple(last.s.shape) == (B,) else plan.counts.float() / plan.num_heads
    holds_unkept = sel.holds_unkept
    attend = getattr(run, "attend", None)
    if callable(attend):
        y, host.last = attend(call.weights, inputs, plan, LastForward(s, plan, query_mask, T, S), holds_unkept)
        return y
    y = run(call.weights, inputs, plan)
    usage = getattr(run, "usage", None)
    host.last = (usage(s, plan, query_mask, T, S, holds_unkept) if callable(usage) else
                 LastForward(s, plan, query_mask, T, S, getattr(run, "name", None), getattr(run, "strategy", None)))
    return y


def score_terms(call: Any, T: int, S: int, bias: Tensor | None) -> Tensor | None:
    """``bias`` (the mask's, or None) plus the layer's own window band (``call.sliding_window``, when there is no
    mask) and ``call.score_bias``; ``call``: anything with ``mask``, ``x``, ``sliding_window`` and ``score_bias``."""
    if call.mask is None and call.sliding_window is not None and S > call.sliding_window:
        band = sliding_window_bias(T, S, int(call.sliding_window), call.x.device, call.x.dtype)  # (1, 1, T, S)
        bias = band if bias is None else bias + band
    if call.score_bias is not None:
        bias = call.score_bias if bias is None else bias + call.score_bias  # (B|1, H, T, S)
    return bias


def sliding_window_bias(T: int, S: int, window: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Additive ``(1, 1, T, S)`` bias forbidding keys more than ``window`` positions back (bottom-right aligned)."""
    i = torch.arange(T, device=device).unsqueeze(1) + (S - T)
    j = torch.arange(S, device=device).unsqueeze(0)
    return additive_bias(j > i - window, dtype)[None, None]


# Masks: libraries hand attention modules a 4-D bool (sdpa) or additive float (eager) mask, a 2-D padding mask
# (flash attention) or None. The derived forms are cached for the last mask seen, because every layer of a forward
# receives the same tensor and the reduction below is O(B*T*S).
_LAST_MASK: list[Any] = [None]  # one (mask, key, parts) tuple, replaced whole (safe if threads share the model)


def mask_parts(mask: Any, B: int, T: int, S: int, self_attention: bool, query_start: int | Tensor | None = None
               ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(query_mask (B,T) | None, key_mask (B,S) | None, attn_bias | None)`` from an attention mask (transformers'
    forms: 2-D ``(B, S)`` padding, 4-D ``(B, 1, T, S)`` bool or additive, or None).

    ``query_start``: the mask column of the first query (default ``S - T``: the queries are the last keys; a static
    cache places them after the cached tokens, before its empty slots), an int or a device scalar (a static layer
    holding a request's compact cache: read on the device, :mod:`condcomp.kv.static`).
    """
    if mask is None:
        return None, None, None
    q0 = S - T if query_start is None else query_start
    on_device = isinstance(q0, Tensor)
    # Keyed by identity and version: a mask edited in place between forwards is derived again. Under torch.compile
    # the parts are derived in the graph (a traced tensor has no version to read), as with a device query_start.
    compiling = torch.compiler.is_compiling() or on_device
    key = (T, S, self_attention, None if on_device else q0,
           None if on_device or not isinstance(mask, Tensor) else tensor_version(mask))  # None under compile
    cached = None if compiling else _LAST_MASK[0]  # (read under compile, it would be guarded on)
    if cached is not None and cached[0] is mask and cached[1] == key and key[4] is not None:
        return cached[2]  # type: ignore[no-any-return]
    if not isinstance(mask, Tensor):
        raise TypeError(f"condcomp received an attention mask of type {type(mask).__name__} (flex attention's "
                        "BlockMask?); load or set the model with attn_implementation='sdpa' or 'eager'")
    if mask.dim() == 2:  # flash-attention style (B, S) padding mask, 1 = real token
        if tuple(mask.shape) != (B, S):
            raise ValueError(f"2-D attention mask must be (B, S) = {(B, S)}, got {tuple(mask.shape)}")
        key_mask = mask.bool()
        parts: tuple[Tensor | None, ...] = (_query_rows(key_mask, q0, T) if self_attention else None, key_mask, None)
    elif mask.dim() == 4:
        check_mask_dtype(mask, "a 4-D attention_mask")
        if mask.dtype == torch.bool:
            allowed = mask
            bias = additive_bias(mask)
        else:
            # eager masks use the dtype's most negative finite number, not -inf (rows stay finite, as in HF)
            allowed = mask > torch.finfo(mask.dtype).min / 2
            bias = mask
        key_ok = attended_keys(allowed, B, S)  # (B, S)
        query_mask = _query_rows(key_ok, q0, T) if self_attention else None
        parts = (query_mask, None, bias)
    else:
        raise ValueError(f"attention mask must be 2-D (B, S) or 4-D (B, 1, T, S), got shape {tuple(mask.shape)}")
    if not compiling:
        _LAST_MASK[0] = (mask, key, parts)
    return parts  # type: ignore[return-value]


def _query_rows(key_ok: Tensor, q0: int | Tensor, T: int) -> Tensor | None:
    """``(B, T)``: the call's queries' columns of ``key_ok (B, S)``; None where they fall outside it."""
    if isinstance(q0, Tensor):
        return query_rows(key_ok, q0, T)
    return key_ok[:, q0:q0 + T] if 0 <= q0 <= key_ok.shape[1] - T else None


__all__ = ["CompactCall", "StepLayer", "attend_compact", "mask_parts", "score_terms", "sliding_window_bias"]
