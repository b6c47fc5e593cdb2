"""A cache the KV-policy tests hand to the ``kv_cache`` executor: stores every key and value it is given (growing
along the tokens) and the policy's state, as a cache layer would; and the prefill-then-one-token-per-call loop that
drives the executor over it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from condcomp.executors.auto import get_executor
from condcomp.executors.cached import CompactKV
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


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


def prefill_then_steps(w: AttentionWeights, x: Tensor, mask: Tensor, plan: HeadPlan, selection: Any, prompt: int,
                       rotary: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, ListCache]:
    """The ``kv_cache`` executor over a :class:`ListCache`: one call on ``x[:, :prompt]``, then one call per
    remaining token; the outputs ``(B, S, D)`` concatenated, and the cache."""
    ex, cache, outs = get_executor("kv_cache"), ListCache(), []
    S = x.shape[1]
    with torch.no_grad():
        for lo, hi in [(0, prompt)] + [(i, i + 1) for i in range(prompt, S)]:
            compact = CompactKV(selection, cache.store, None, cache.windows, cache.keep)
            rot = None if rotary is None else (rotary[0][:, lo:hi], rotary[1][:, lo:hi])
            inputs = AttentionInputs(x=x[:, lo:hi], mask=mask[:, lo:hi], key_mask=mask[:, :hi], rotary=rot)
            outs.append(ex(w, inputs, plan, cache=compact))
    return torch.cat(outs, 1), cache
