"""Telling whether a tensor changed since it was last seen, without reading it (no device sync).

Caches of derived values (a transformers mask's parts, a merged LoRA weight, the progress pushed to the schedules)
key on the tensor's identity and its version counter, which every in-place write increments.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tensor_version(t: Tensor) -> int | None:
    """The version counter of ``t``; None for inference tensors (made under ``torch.inference_mode``), which have
    none, and under ``torch.compile``, where a traced tensor has none to read: a cache must then treat the tensor as
    changed (the derived value is computed in the graph)."""
    if torch.compiler.is_compiling():
        return None
    return None if t.is_inference() else t._version
