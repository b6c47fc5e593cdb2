"""A cache the KV-policy tests hand to the ``kv_cache`` executor: stores every key and value it is given (growing
along the tokens) and the policy's state, as a cache layer would."""

from __future__ import annotations

import torch
from torch import Tensor


class ListCache:
    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.windows: object = None

    def store(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.k, self.v

    def keep(self, windows: object) -> None:
        self.windows = windows
