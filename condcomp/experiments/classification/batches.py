"""EncodedSplit: a tokenised split held as tensors (ids, mask, segments, labels, per-example tags), and batching."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class EncodedSplit:
    """One split, padded to a common length. ``tags``: optional per-example group (e.g. "easy"/"hard")."""

    ids: Tensor  # (N, T) int64, 0 = padding
    mask: Tensor  # (N, T) bool, True = real token
    labels: Tensor  # (N,) int64
    segments: Tensor | None = None  # (N, T) int64 for sentence pairs
    tags: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # e.g. skipped rows, source files

    def __post_init__(self) -> None:
        N = self.ids.shape[0]
        if self.mask.shape != self.ids.shape or self.labels.shape != (N,):
            raise ValueError(f"inconsistent split: ids {tuple(self.ids.shape)}, mask {tuple(self.mask.shape)}, "
                             f"labels {tuple(self.labels.shape)}")
        if self.tags is not None and len(self.tags) != N:
            raise ValueError(f"tags has {len(self.tags)} entries for {N} examples")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def subset(self, index: Tensor) -> EncodedSplit:
        """The examples at ``index`` (a 1-D int64 tensor)."""
        tags = [self.tags[i] for i in index.tolist()] if self.tags is not None else None
        seg = self.segments[index] if self.segments is not None else None
        return EncodedSplit(self.ids[index], self.mask[index], self.labels[index], seg, tags, dict(self.info))

    def batches(self, batch_size: int, shuffle: bool = False, generator: torch.Generator | None = None,
                trim: bool = True) -> Iterator[tuple[Tensor, Tensor, Tensor | None, Tensor]]:
        """``(ids, mask, segments, labels)`` batches; ``trim`` cuts trailing all-padding columns (less work)."""
        N = len(self)
        order = torch.randperm(N, generator=generator) if shuffle else torch.arange(N)
        for start in range(0, N, batch_size):
            idx = order[start:start + batch_size]
            ids, mask = self.ids[idx], self.mask[idx]
            seg = self.segments[idx] if self.segments is not None else None
            if trim:
                T = int(mask.sum(1).max().clamp_min(1))
                ids, mask = ids[:, :T], mask[:, :T]
                seg = seg[:, :T] if seg is not None else None
            yield ids, mask, seg, self.labels[idx]


def on_device(batch: tuple[Tensor, Tensor, Tensor | None, Tensor], device: torch.device
              ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """A ``batches()`` item moved to ``device`` (a no-op on the CPU)."""
    if device.type == "cpu":
        return batch
    ids, mask, seg, labels = batch
    return ids.to(device), mask.to(device), seg.to(device) if seg is not None else None, labels.to(device)
