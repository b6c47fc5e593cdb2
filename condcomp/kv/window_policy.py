"""The ``window`` KV policy: a group keeps its request's first ``sinks`` tokens and its last ``window`` tokens.

Its state is a :class:`~condcomp.kv.window.WindowCache` per layer (quantized as the layer's own keys in a quantized
cache, :mod:`condcomp.kv.window_quant`); a query at real-token position ``p`` reads keys ``j <= p`` with
``j < sinks`` or ``p - j < window`` (:func:`condcomp.masks.streaming_allowed`), and within the model's own sliding
window where the layer has one (``model_window``: a streamed group never reads a key its full group would not).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from condcomp.dense import grouped_sdpa
from condcomp.kv.fixed_slots import RingWindow, refuse_position_bias
from condcomp.kv.policy import KVPolicy
from condcomp.kv.position_bias import RelativeBias, biased_mask, check_contiguous
from condcomp.kv.window import (
    WINDOW_OPTIONS,
    StreamWindow,
    WindowCache,
    band_applies,
    banded_attention,
    extend,
    first_call_tail,
    query_positions,
    trim,
)
from condcomp.kv.window_quant import QuantizedWindowCache, WindowCodec
from condcomp.options import Option
from condcomp.registry import register_kv_policy


@register_kv_policy("window")
@dataclass(frozen=True)
class WindowKV(KVPolicy):
    """Streaming groups: the first ``sinks`` tokens and the last ``window`` tokens of each request, at most
    ``sinks + window`` cached tokens per group whatever the context.

    ``model_window``: the model's own sliding window on the layer, set by the attachment
    (:meth:`within_model_window`); the groups then read what both windows allow.

    >>> WindowKV(sinks=4, window=60).window_spec.capacity
    64
    """

    sinks: int = 4
    window: int = 64
    model_window: int | None = None
    stores: ClassVar[str] = "own"
    reads_position_bias: ClassVar[bool] = True  # T5: each kept key's bias at its true position
    holds_fixed_slots: ClassVar[bool] = True  # sinks + window slots (a ring, condcomp.kv.fixed_slots)
    options: ClassVar[tuple[Option, ...]] = WINDOW_OPTIONS

    @functools.cached_property
    def window_spec(self) -> StreamWindow:
        """The same window as a :class:`~condcomp.kv.window.StreamWindow` (built and checked once per policy, not
        at every decode step)."""
        return StreamWindow(self.sinks, self.window, self.model_window)

    def within_model_window(self, sliding_window: int) -> WindowKV:
        narrower = sliding_window if self.model_window is None else min(sliding_window, self.model_window)
        return dataclasses.replace(self, model_window=int(narrower))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, query_mask: Tensor | None, scale: float,
               keep: bool, position_bias: RelativeBias | None = None) -> tuple[Tensor, Tensor, Any]:
        window = self.window_spec
        B, _, T, _ = q.shape
        if isinstance(state, RingWindow):  # a static cache: the ring is written in place
            refuse_position_bias(position_bias, self.name)
            out, dead = state.attend(q, k, v, query_mask, scale, window)
            return out, dead, state
        if position_bias is not None:
            check_contiguous(self.name, query_mask, state is None)
        pos = query_positions(None if state is None else state.seen, query_mask, B, T, q.device)  # (B, T)
        keys, values, key_pos = extend(state, k, v, pos)
        if state is None and band_applies(query_mask, T, window):  # a long prefill: block by block
            dead = pos < 0  # (B, T): padding queries
            out = banded_attention(q, keys, values, pos, window,
                                   lambda qb, kb, vb, m: grouped_sdpa(qb, kb, vb, m, False, scale), position_bias)
        else:
            allowed = window.allowed(pos, key_pos)  # (B, T, N)
            dead = ~allowed.any(-1)  # (B, T): padding queries
            scores = None if position_bias is None else position_bias.at(pos, key_pos)  # (B, gw*r, T, N)
            mask = biased_mask((allowed | dead.unsqueeze(-1)).unsqueeze(1), scores, q.dtype)
            out = grouped_sdpa(q, keys, values, mask, False, scale)
        new = None
        if keep:
            seen = (pos.amax(-1) + 1).clamp_min(0 if state is None else state.seen)  # (B,)
            # a later call of several tokens keeps them all until the next call: a verifier (assisted decoding) may
            # crop them again; a prefill is trimmed to the window (its bytes are what the window promises) but for
            # the candidates after the prompt it carries (assisted decoding's first call, see revertible_tail)
            slack = T - 1 if state is not None else min(first_call_tail(), T - 1)
            new = trim(keys, values, key_pos, seen, window, slack=max(slack, 0))
        return out, dead.unsqueeze(1), new

    def crop(self, state: Any, tokens: int) -> Any:
        return state.crop(tokens, self.window_spec)

    def fixed_slots(self, state: Any, room: int) -> Any:
        return RingWindow.from_cache(state, self.window_spec, room)

    def stored(self, state: Any, codec: Any, before: Any) -> Any:
        if not isinstance(codec, WindowCodec) or not isinstance(state, WindowCache):
            return state
        return QuantizedWindowCache.store(state, codec, before if isinstance(before, QuantizedWindowCache) else None)

    def loaded(self, stored: Any) -> Any:
        return stored.dequantized() if isinstance(stored, QuantizedWindowCache) else stored
