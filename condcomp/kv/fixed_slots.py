"""A KV policy's state in storage allocated once at prefill: what a static cache under ``torch.compile`` needs.

On a static cache (transformers' ``StaticCache``) a decode step is captured once and replayed (``torch.compile``,
CUDA graphs): no tensor may change shape or address from step to step and no count may be read on the host. A KV
policy that holds a fixed number of slots after the prefill keeps its groups here instead of in a state that is
cut and concatenated at every call:

- :class:`RingWindow` (``window``): per (request, group) ``sinks`` slots, then a ring of ``recent`` slots; a token
  at real-token position ``p >= sinks`` is written to slot ``sinks + (p - sinks) mod recent``.
- :class:`SlotRegion` (``snapkv``, ``adakv``): the tokens the prefill selected, then a region for every token the
  static cache can still take (``max_cache_len`` less the prefill's columns), appended in order.

Both hold **the valid slots of each (request, group) as** ``[0, length)``, ``length (B, gw)`` an int64 device
tensor: attention over keys does not depend on their order (rotary is already in the keys), so a query reads every
valid slot (a kernel reading these pools reads ``length`` slots per (request, group)). A decode step of one token
writes it in place (``scatter_`` at a device index), advances ``seen`` and ``length`` in place, then attends over
the pool; a call of several tokens (a second turn) attends over the pool and its own keys by the policy's rule
(the ring's slots know their positions from ``seen``), then writes what the pool keeps. Beam reordering permutes
the rows in place (the addresses a captured step reads stay the same).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.dense import grouped_sdpa
from condcomp.kv.window import StreamWindow, WindowCache, query_positions


def _static(*tensors: Tensor) -> None:
    """Mark preallocated storage as static (a compiled step with CUDA graphs reads it at a fixed address)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        torch._dynamo.mark_static_address(t)


def refuse_position_bias(name: str) -> None:
    """Refuse a relative position bias (T5) on the preallocated slots of the KV policy ``name`` (the caller has
    one: a call without a bias enters nothing here)."""
    raise ValueError(f"the KV policy {name!r} on a static cache cannot add a relative position bias (T5) to its "
                     "slots: generate with the default DynamicCache on such a model")


def _attend_pool(q: Tensor, keys: Tensor, values: Tensor, length: Tensor, scale: float) -> Tensor:
    """One query per head over pools ``(B, gw, C, Dh)`` reading slots ``[0, length (B, gw))``: ``q (B, gw*r, 1,
    Dh)`` -> ``(B, gw*r, 1, Dh)``. A (request, group) with no valid slot reads every slot (its output is zeroed as
    a dead query or a spare slot by the caller; this only keeps it finite)."""
    B, H, _, Dh = q.shape
    gw, C = keys.shape[1], keys.shape[2]
    valid = torch.arange(C, device=keys.device) < length.unsqueeze(-1)  # (B, gw, C)
    valid = valid | (length == 0).unsqueeze(-1)
    out = F.scaled_dot_product_attention(q.reshape(B, gw, H // gw, Dh), keys, values,
                                         attn_mask=valid.unsqueeze(2), scale=scale)  # (B, gw, r, Dh)
    return out.reshape(B, H, 1, Dh)


def _attend_with(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Several queries over ``keys (B, gw, N, Dh)`` with ``allowed (B, gw|1, T, N)``; dead queries (no key in any
    group) read every key (zeroed by the caller). Returns ``(out (B, gw*r, T, Dh), dead (B, 1, T))``."""
    gw, r = keys.shape[1], q.shape[1] // keys.shape[1]
    dead = ~allowed.any(-1).any(1)  # (B, T)
    ok = (allowed | dead[:, None, :, None]).expand(-1, gw, -1, -1).repeat_interleave(r, dim=1)  # (B, gw*r, T, N)
    return grouped_sdpa(q, keys, values, ok, False, scale), dead.unsqueeze(1)


def _write_one(pool: Tensor, slot: Tensor, new: Tensor, ok: Tensor) -> None:
    """Write ``new (B, gw, 1, Dh)`` into ``pool (B, gw, C, Dh)`` at ``slot (B, gw)`` where ``ok (B, gw)``, in
    place (a slot not written keeps its value)."""
    index = slot[:, :, None, None].expand(-1, -1, 1, pool.shape[-1])
    old = pool.gather(2, index)
    pool.scatter_(2, index, torch.where(ok[:, :, None, None], new, old))


def _write_many(pool: Tensor, slot: Tensor, new: Tensor, ok: Tensor) -> None:
    """Write the tokens ``new (B, gw, T, Dh)`` into ``pool (B, gw, C, Dh)`` at ``slot (B, gw, T)`` where ``ok (B, gw,
    T)`` (at most one token per slot), in place: each slot takes its token or keeps its value."""
    C = pool.shape[2]
    hit = (slot.unsqueeze(-1) == torch.arange(C, device=pool.device)) & ok.unsqueeze(-1)  # (B, gw, T, C)
    has = hit.any(2)  # (B, gw, C)
    src = hit.to(torch.int8).argmax(2)  # (B, gw, C): the token written to each slot
    taken = new.gather(2, src.unsqueeze(-1).expand(-1, -1, -1, new.shape[-1]))  # (B, gw, C, Dh)
    pool.copy_(torch.where(has.unsqueeze(-1), taken, pool))


@dataclass(frozen=True)
class RingWindow:
    """A streamed group's storage for the ``window`` policy on a static cache: ``keys``/``values (B, gw, C, Dh)``
    with ``C = sinks + recent`` (the first ``sinks`` slots hold positions ``0..sinks-1``, the rest a ring of the
    last ``recent`` tokens; fewer where the request can never hold ``C`` tokens: the ring then never wraps),
    ``seen (B,)`` real tokens so far and ``length (B, gw)`` valid slots (``min(seen, C)``)."""

    keys: Tensor
    values: Tensor
    seen: Tensor
    length: Tensor
    sinks: int
    recent: int

    @classmethod
    def from_cache(cls, state: WindowCache, window: StreamWindow, room: int) -> RingWindow:
        """The ring holding what a prefill's :class:`~condcomp.kv.window.WindowCache` keeps, for ``room`` tokens to
        come (eager: at prefill)."""
        B, gw, _, Dh = state.keys.shape
        sinks, recent = window.sinks, window.recent
        most = int(state.seen.max()) + room if B else 0  # the most real tokens a row can ever hold
        C = max(min(sinks + recent, most), 1)
        keys, values = state.keys.new_zeros(B, gw, C, Dh), state.values.new_zeros(B, gw, C, Dh)
        pos, seen = state.positions, state.seen  # (B, N), (B,)
        keep = (pos >= 0) & ((pos < sinks) | (pos >= (seen - recent).unsqueeze(-1)))  # what the ring holds
        rows, entries = keep.nonzero(as_tuple=True)
        slots = ring_slot(pos[rows, entries], sinks, recent)
        keys.permute(0, 2, 1, 3)[rows, slots] = state.keys.permute(0, 2, 1, 3)[rows, entries]
        values.permute(0, 2, 1, 3)[rows, slots] = state.values.permute(0, 2, 1, 3)[rows, entries]
        seen = seen.clone()
        length = seen.clamp_max(C).unsqueeze(-1).expand(B, gw).contiguous()
        _static(keys, values, seen, length)
        return cls(keys, values, seen, length, sinks, recent)

    @property
    def capacity(self) -> int:
        return self.sinks + self.recent

    def tensors(self) -> tuple[Tensor, ...]:
        return self.keys, self.values, self.seen, self.length

    def slot_positions(self) -> Tensor:
        """``(B, C)``: the real-token position each slot holds (``-1``: not written yet)."""
        s = torch.arange(self.keys.shape[2], device=self.seen.device)  # (C,)
        last = (self.seen - 1).unsqueeze(-1)  # (B, 1)
        ring = last - (last - s).remainder(max(self.recent, 1))  # the latest position written to each ring slot
        pos = torch.where(s < self.sinks, s.expand_as(ring), ring)
        return pos.masked_fill(s >= self.seen.unsqueeze(-1), -1)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, query_mask: Tensor | None, scale: float,
               window: StreamWindow) -> tuple[Tensor, Tensor]:
        """A call after the prefill: ``q (B, gw*r, T, Dh)``, ``k``/``v (B, gw, T, Dh)``; writes what the ring keeps
        in place. Returns ``(out, dead (B, 1, T))``."""
        B, _, T, _ = q.shape
        pos = query_positions(self.seen, query_mask, B, T, q.device)  # (B, T), -1 padding
        seen = torch.maximum(pos.amax(-1) + 1, self.seen)  # (B,)
        if T == 1:  # write first, then read the ring: it holds exactly what the query may read
            slot = ring_slot(pos.clamp_min(0), self.sinks, self.recent).expand(B, k.shape[1])  # (B, gw)
            ok = (pos >= 0).expand(B, k.shape[1])
            _write_one(self.keys, slot, k, ok)
            _write_one(self.values, slot, v, ok)
            self._advance(seen)
            return _attend_pool(q, self.keys, self.values, self.length, scale), (pos < 0).unsqueeze(1)
        key_pos = torch.cat([self.slot_positions(), pos], 1)  # (B, C + T)
        allowed = window.allowed(pos, key_pos).unsqueeze(1)  # (B, 1, T, C + T)
        out, dead = _attend_with(q, torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2), allowed, scale)
        keep = (pos >= 0) & ((pos < self.sinks) | (pos >= (seen - self.recent).unsqueeze(-1)))  # (B, T)
        slot = ring_slot(pos.clamp_min(0), self.sinks, self.recent).unsqueeze(1).expand(B, k.shape[1], T)
        ok = keep.unsqueeze(1).expand_as(slot)
        _write_many(self.keys, slot, k, ok)
        _write_many(self.values, slot, v, ok)
        self._advance(seen)
        return out, dead

    def _advance(self, seen: Tensor) -> None:
        self.seen.copy_(seen)
        self.length.copy_(seen.clamp_max(self.capacity).unsqueeze(-1).expand_as(self.length))

    def crop(self, tokens: int, window: StreamWindow) -> RingWindow:
        """Without each request's last ``tokens`` tokens, in place; refused where the ring already overwrote a key
        the next query reads (more than one token once a row has held more than ``sinks + recent``)."""
        if tokens == 0:
            return self
        full = self.seen > self.capacity
        if tokens > 1 and bool(full.any()):
            raise ValueError(
                f"cannot crop {tokens} tokens from this static KV cache: its window groups' rings (the first "
                f"{self.sinks} and the last {self.recent} tokens) already overwrote tokens the next query would "
                f"read in row(s) {full.nonzero().flatten().tolist()}; crop one token at a time, or generate with the "
                "default DynamicCache (its window keeps the last call's tokens until the next)")
        self._advance((self.seen - tokens).clamp_min(0))
        return self

    def take_rows(self, index: Tensor) -> RingWindow:
        """Rows ``index``: a permutation of the rows in place (beams: the addresses stay), any other selection as
        new storage."""
        i = index.to(self.keys.device)
        if i.dtype != torch.bool and i.numel() == self.seen.numel():
            for t in self.tensors():
                t.copy_(t.index_select(0, i))
            return self
        return dataclasses.replace(self, keys=self.keys[i], values=self.values[i], seen=self.seen[i],
                                   length=self.length[i])


def ring_slot(pos: Tensor, sinks: int, recent: int) -> Tensor:
    """The ring slot of real-token position ``pos`` (``>= 0``): ``pos`` for a sink, else
    ``sinks + (pos - sinks) mod recent``."""
    return torch.where(pos < sinks, pos, sinks + (pos - sinks).remainder(max(recent, 1)))


@dataclass(frozen=True)
class SlotRegion:
    """The groups of ``snapkv`` / ``adakv`` on a static cache: ``keys``/``values (B, gw, N, Dh)``, each (request,
    group)'s selected prompt tokens first then every later token (``length (B, gw)`` valid slots), ``seen (B,)``
    real tokens so far, ``prompt (B,)`` the prompt's real tokens; ``N`` = the largest selection plus the tokens the
    static cache can still take. ``prefill_only``: as :class:`~condcomp.kv.snapkv.SnapState`'s."""

    keys: Tensor
    values: Tensor
    length: Tensor
    seen: Tensor
    prompt: Tensor
    prefill_only: bool = False

    @classmethod
    def from_state(cls, keys: Tensor, values: Tensor, positions: Tensor, seen: Tensor, prompt: Tensor,
                   room: int, prefill_only: bool) -> SlotRegion:
        """The region holding a prefill's state (``positions (B, gw, n)``, -1 = empty) with ``room`` slots more."""
        B, gw, n, Dh = keys.shape
        order = ((positions < 0).long() * n + torch.arange(n, device=keys.device)).argsort(-1)  # held first
        index = order.unsqueeze(-1).expand(B, gw, n, Dh)
        pool_k, pool_v = keys.new_zeros(B, gw, n + room, Dh), values.new_zeros(B, gw, n + room, Dh)
        pool_k[:, :, :n] = keys.gather(2, index)
        pool_v[:, :, :n] = values.gather(2, index)
        length, seen, prompt = (positions >= 0).sum(-1), seen.clone(), prompt.clone()
        _static(pool_k, pool_v, length, seen)
        return cls(pool_k, pool_v, length, seen, prompt, prefill_only)

    def tensors(self) -> tuple[Tensor, ...]:
        return self.keys, self.values, self.length, self.seen, self.prompt

    def attend(self, q: Tensor, k: Tensor, v: Tensor, query_mask: Tensor | None, scale: float
               ) -> tuple[Tensor, Tensor]:
        """A call after the prefill (every token kept, appended at each (request, group)'s ``length``), in place.
        Returns ``(out, dead (B, 1, T))``."""
        B, _, T, _ = q.shape
        gw, N = k.shape[1], self.keys.shape[2]
        pos = query_positions(self.seen, query_mask, B, T, q.device)  # (B, T)
        real = pos >= 0
        seen = torch.maximum(pos.amax(-1) + 1, self.seen)
        if T == 1:
            slot = self.length.clamp_max(N - 1)  # (B, gw); a full region: the static cache refused the write
            ok = real.expand(B, gw)
            _write_one(self.keys, slot, k, ok)
            _write_one(self.values, slot, v, ok)
            self.length.add_(ok.long())
            self.seen.copy_(seen)
            return _attend_pool(q, self.keys, self.values, self.length, scale), (~real).unsqueeze(1)
        held = torch.arange(N, device=k.device) < self.length.unsqueeze(-1)  # (B, gw, N)
        causal = (pos.unsqueeze(-1) >= pos.unsqueeze(-2)) & real.unsqueeze(-2) & real.unsqueeze(-1)  # (B, T, T)
        allowed = torch.cat([held.unsqueeze(2) & real[:, None, :, None], causal.unsqueeze(1).expand(B, gw, T, T)], -1)
        out, dead = _attend_with(q, torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2), allowed, scale)
        rank = real.long().cumsum(-1) - 1  # (B, T): each real token's order in the call
        slot = (self.length.unsqueeze(-1) + rank.unsqueeze(1)).clamp(0, N - 1)  # (B, gw, T)
        ok = real.unsqueeze(1).expand_as(slot)
        _write_many(self.keys, slot, k, ok)
        _write_many(self.values, slot, v, ok)
        self.length.add_(real.sum(-1, keepdim=True))
        self.seen.copy_(seen)
        return out, dead

    def crop(self, tokens: int) -> SlotRegion:
        """Without each request's last ``tokens`` tokens (all after the prompt), in place."""
        self.length.sub_(tokens).clamp_min_(0)
        self.seen.sub_(tokens)
        return dataclasses.replace(self, prefill_only=False) if self.prefill_only else self

    def take_rows(self, index: Tensor) -> SlotRegion:
        """Rows ``index``: a permutation in place (beams), any other selection as new storage."""
        i = index.to(self.keys.device)
        if i.dtype != torch.bool and i.numel() == self.seen.numel():
            for t in self.tensors():
                t.copy_(t.index_select(0, i))
            return self
        return SlotRegion(self.keys[i], self.values[i], self.length[i], self.seen[i], self.prompt[i],
                          self.prefill_only)


__all__ = ["RingWindow", "SlotRegion", "refuse_position_bias", "ring_slot"]
