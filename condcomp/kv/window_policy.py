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

from condcomp.kv.fixed_slots import RingWindow, refuse_position_bias
from condcomp.kv.policy import KVPolicy
from condcomp.kv.position_bias import RelativeBias, check_contiguous
from condcomp.kv.window import WINDOW_OPTIONS, StreamWindow, WindowCache, attend_window
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
        if isinstance(state, RingWindow):  # a static cache: the ring is written in place
            if position_bias is not None:
                refuse_position_bias(self.name)
            out, dead = state.attend(q, k, v, query_mask, scale, self.window_spec)
            return out, dead, state
        if position_bias is not None:
            check_contiguous(self.name, query_mask, state is None)
        return attend_window(q, k, v, state, query_mask, scale, self.window_spec, keep, position_bias)

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
