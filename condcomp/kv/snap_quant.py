"""SnapKV / AdaKV token state stored quantized, inside a quantized KV cache layer (fp8, HQQ, quanto).

A :class:`~condcomp.kv.snapkv.SnapState` held by a quantized layer keeps its keys and values as codes by the
layer's own rule (:class:`~condcomp.kv.window_quant.WindowCodec`: fp8 with the scale of the state's first store
frozen, as transformers' ``Fp8QuantizedLayer``; ``nbits`` codes per ``group`` channels for HQQ/quanto), per entry,
so selecting rows moves codes and scales together and an entry quantized again keeps its codes (no drift while the
state grows by one entry per token). Positions and counts stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from condcomp.kv.window_quant import QuantizedStates, WindowCodec


@dataclass(frozen=True)
class QuantizedSnapState:
    """A ``SnapState`` whose ``keys``/``values (B, gw, N, Dh)`` are held as codes; the other fields as is."""

    keys: QuantizedStates
    values: QuantizedStates
    positions: Tensor
    seen: Tensor
    prompt: Tensor
    prefill_only: bool
    codec: WindowCodec

    @staticmethod
    def store(state: Any, codec: WindowCodec, before: QuantizedSnapState | None = None) -> QuantizedSnapState:
        """``state`` (a ``SnapState``) quantized; ``before``: what the layer held (its fp8 scales stay frozen)."""
        return QuantizedSnapState(codec.quantize(state.keys, before.keys if before is not None else None),
                                  codec.quantize(state.values, before.values if before is not None else None),
                                  state.positions, state.seen, state.prompt, bool(state.prefill_only), codec)

    def dequantized(self, state_class: Any) -> Any:
        """The state an executor reads, as ``state_class`` (``SnapState``)."""
        return state_class(self.codec.dequantize(self.keys), self.codec.dequantize(self.values), self.positions,
                           self.seen, self.prompt, self.prefill_only)

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor held (codes, scales, zero points, positions, counts): what the state costs in bytes."""
        return (*self.keys.tensors(), *self.values.tensors(), self.positions, self.seen, self.prompt)

    def take_rows(self, index: Tensor) -> QuantizedSnapState:
        i = index.to(self.positions.device)
        return replace(self, keys=self.keys.take_rows(i), values=self.values.take_rows(i),
                       positions=self.positions[i], seen=self.seen[i], prompt=self.prompt[i])
