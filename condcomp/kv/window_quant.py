"""Streamed-group windows stored quantized, for a quantized KV cache layer that holds them beside its own keys.

A window (:class:`~condcomp.kv.window.WindowCache`) is trimmed at every step: its oldest recent token
leaves and the new one enters, so entries move within the tensor. Its keys and values are therefore quantized
*per entry*: every (row, key/value head, token) carries its own codes and its own scale, so trimming or selecting
rows moves codes and scales together, and quantizing an entry that was already quantized gives back the same codes
(its minimum and maximum are grid points; tested), so entries do not drift while they stay in the window.

- ``fp8``: float8 e4m3 codes with one scale per tensor, calibrated on the window's first store and then frozen, as
  transformers' ``Fp8QuantizedLayer`` does for its keys (values beyond the range saturate instead of becoming NaN);
- ``int``: ``nbits``-bit asymmetric round-to-nearest codes packed into bytes, one scale and zero point (in the
  states' dtype) per entry and ``group`` channels, as transformers' HQQ/quanto layers group 64 channels. Unlike
  those layers no recent tokens are kept in full precision: every window entry is stored quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from condcomp.kv.window import StreamWindow, WindowCache, crop_positions

_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max


@dataclass(frozen=True)
class QuantizedStates:
    """``(B, gw, N, Dh)`` states as codes: fp8 ``codes`` with a scalar ``scale``, or packed ``nbits`` codes
    ``(B, gw, N, Dh * nbits / 8)`` (uint8) with ``scale``/``zero (B, gw, N, Dh / group)``."""

    codes: Tensor
    scale: Tensor
    zero: Tensor | None
    head_dim: int
    dtype: torch.dtype

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.codes, self.scale) if self.zero is None else (self.codes, self.scale, self.zero)

    def take_rows(self, i: Tensor) -> QuantizedStates:
        if self.zero is None:  # one scale for the tensor
            return QuantizedStates(self.codes[i], self.scale, None, self.head_dim, self.dtype)
        return QuantizedStates(self.codes[i], self.scale[i], self.zero[i], self.head_dim, self.dtype)


@dataclass(frozen=True)
class WindowCodec:
    """How a window's keys and values are quantized: ``kind`` ``"fp8"`` or ``"int"`` (``nbits`` 1..8, scales per
    ``group`` channels; a head size that ``group`` does not divide gets one group per entry)."""

    kind: str
    nbits: int = 8
    group: int = 64

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "int"):
            raise ValueError(f"WindowCodec kind {self.kind!r}: use 'fp8' or 'int'")
        if self.kind == "int" and not 1 <= self.nbits <= 8:
            raise ValueError(f"WindowCodec nbits={self.nbits}: integer codes of 1 to 8 bits are supported")

    def quantize(self, x: Tensor, like: QuantizedStates | None = None) -> QuantizedStates:
        """``x (B, gw, N, Dh)`` as codes; ``like``: the states stored before (fp8 keeps their frozen scale)."""
        if self.kind == "fp8":
            top = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
            if like is None or like.codes.numel() == 0:  # an empty store has no range: calibrate on the next
                scale = (top / _FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            else:
                scale = like.scale
            codes = (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
            return QuantizedStates(codes, scale, None, x.shape[-1], x.dtype)
        *lead, Dh = x.shape
        g = self.group if Dh % self.group == 0 else Dh
        xg = x.float().reshape(*lead, Dh // g, g)  # (B, gw, N, Dh/g, g)
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        levels = (1 << self.nbits) - 1
        scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
        q = ((xg - lo) / scale).round_().clamp_(0, levels).to(torch.uint8).reshape(*lead, Dh)
        return QuantizedStates(self._pack(q), scale.squeeze(-1).to(x.dtype), lo.squeeze(-1).to(x.dtype), Dh, x.dtype)

    def dequantize(self, s: QuantizedStates) -> Tensor:
        if s.zero is None:
            return (s.codes.float() * s.scale).to(s.dtype)
        q = self._unpack(s.codes, s.head_dim).float()  # (B, gw, N, Dh)
        groups = s.scale.shape[-1]
        qg = q.reshape(*q.shape[:-1], groups, s.head_dim // groups)
        x = qg * s.scale.float().unsqueeze(-1) + s.zero.float().unsqueeze(-1)
        return x.reshape(q.shape).to(s.dtype)

    def _per_byte(self, Dh: int) -> int:
        per = 8 // self.nbits
        return per if Dh % per == 0 else 1

    def _pack(self, q: Tensor) -> Tensor:
        per = self._per_byte(q.shape[-1])
        if per == 1:
            return q
        q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
        packed = torch.zeros(q.shape[:-1], dtype=torch.uint8, device=q.device)
        for j in range(per):
            packed |= q[..., j] << (self.nbits * j)
        return packed

    def _unpack(self, packed: Tensor, Dh: int) -> Tensor:
        per = self._per_byte(Dh)
        if per == 1:
            return packed
        mask = (1 << self.nbits) - 1
        parts = [(packed >> (self.nbits * j)) & mask for j in range(per)]
        return torch.stack(parts, -1).reshape(*packed.shape[:-1], Dh)


@dataclass(frozen=True)
class QuantizedWindowCache:
    """A :class:`WindowCache` whose keys and values are held as codes (``positions``/``seen`` unchanged); answers
    the same row and crop operations, and :meth:`dequantized` gives the window an executor reads."""

    keys: QuantizedStates
    values: QuantizedStates
    positions: Tensor
    seen: Tensor
    codec: WindowCodec

    @staticmethod
    def store(windows: WindowCache, codec: WindowCodec, before: QuantizedWindowCache | None = None
              ) -> QuantizedWindowCache:
        """``windows`` quantized; ``before``: the layer's previous window (its fp8 scales stay frozen)."""
        return QuantizedWindowCache(codec.quantize(windows.keys, before.keys if before is not None else None),
                                    codec.quantize(windows.values, before.values if before is not None else None),
                                    windows.positions, windows.seen, codec)

    def dequantized(self) -> WindowCache:
        return WindowCache(self.codec.dequantize(self.keys), self.codec.dequantize(self.values), self.positions,
                           self.seen)

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor held (codes, scales, zero points, positions, counts): what the window costs in bytes."""
        return (*self.keys.tensors(), *self.values.tensors(), self.positions, self.seen)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def take_rows(self, index: Tensor) -> QuantizedWindowCache:
        i = index.to(self.positions.device)
        return QuantizedWindowCache(self.keys.take_rows(i), self.values.take_rows(i), self.positions[i],
                                    self.seen[i], self.codec)

    def crop(self, tokens: int, window: StreamWindow) -> QuantizedWindowCache:
        positions, seen = crop_positions(self.positions, self.seen, tokens, window)
        return QuantizedWindowCache(self.keys, self.values, positions, seen, self.codec)
