"""A KV policy that exists only for the tests: one file plus its registration, nothing else in the library touched.

``sinks_only(sinks=n)``: a group the plan does not keep holds its request's first ``n`` tokens only; a query at
real-token position ``p`` reads keys ``j <= p`` with ``j < n``. Its state is its own small dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

import condcomp
from condcomp.dense import grouped_sdpa
from condcomp.kv.window import query_positions, take_entries


@dataclass(frozen=True)
class Sinks:
    """``keys``/``values (B, gw, n, Dh)``, ``positions (B, n)`` (-1 = empty), ``seen (B,)`` real tokens so far."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    seen: Tensor

    def take_rows(self, index: Tensor) -> Sinks:
        i = index.to(self.keys.device)
        return Sinks(self.keys[i], self.values[i], self.positions[i], self.seen[i])

    def tensors(self) -> tuple[Tensor, ...]:
        return self.keys, self.values, self.positions, self.seen


@condcomp.register_kv_policy("sinks_only", override=True)
@dataclass(frozen=True)
class SinksOnlyKV(condcomp.KVPolicy):
    sinks: int = 2
    options: ClassVar[tuple[condcomp.options.Option, ...]] = (condcomp.options.count("sinks"),)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, query_mask: Tensor | None, scale: float,
               keep: bool) -> tuple[Tensor, Tensor, Any]:
        B, _, T, _ = q.shape
        pos = query_positions(None if state is None else state.seen, query_mask, B, T, q.device)  # (B, T)
        if state is not None:
            k, v = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)
            key_pos = torch.cat([state.positions, pos], 1)  # (B, N)
        else:
            key_pos = pos
        allowed = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= pos[:, :, None]) & (
            key_pos[:, None, :] < self.sinks)  # (B, T, N)
        dead = ~allowed.any(-1)  # (B, T)
        out = grouped_sdpa(q, k, v, (allowed | dead.unsqueeze(-1)).unsqueeze(1), False, scale)
        if not keep:
            return out, dead.unsqueeze(1), None
        n = min(self.sinks, key_pos.shape[1])
        is_sink = (key_pos >= 0) & (key_pos < self.sinks)
        score = torch.where(is_sink, -key_pos, torch.full_like(key_pos, -(1 << 40)))  # earliest sinks first
        chosen = score.topk(n, dim=-1).indices  # (B, n)
        kept_pos = key_pos.gather(1, chosen).masked_fill(~is_sink.gather(1, chosen), -1)
        seen = (pos.amax(-1) + 1).clamp_min(0 if state is None else state.seen)  # (B,)
        return out, dead.unsqueeze(1), Sinks(take_entries(k, chosen), take_entries(v, chosen), kept_pos, seen)

    def crop(self, state: Any, tokens: int) -> Any:
        seen = (state.seen - tokens).clamp_min(0)
        positions = state.positions.masked_fill(state.positions >= seen.unsqueeze(-1), -1)
        return Sinks(state.keys, state.values, positions, seen)
