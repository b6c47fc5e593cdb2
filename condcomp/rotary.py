"""Rotate-half rotary position embeddings (RoPE), as Llama-style models apply them to queries and keys."""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(t: Tensor) -> Tensor:
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary embedding of ``t (N, h, T, Dh)`` with ``cos``/``sin`` ``(N, T, Dh)``."""
    return t * cos.unsqueeze(1) + rotate_half(t) * sin.unsqueeze(1)
