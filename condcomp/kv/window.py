"""The cache of a request's streamed key/value groups: its first ``sinks`` tokens and its last ``window`` tokens.

A streamed group's keys and values live in one trimmed tensor per layer, ``(B, gw, N, Dh)`` with
``N <= sinks + window``, beside the full-length cache of the fully kept groups; rows with different streamed
groups share it as the compact cache does (:class:`~condcomp.kv.selection.KVSelection`). Each entry remembers the
real-token position of its token (``-1``: empty), so the streaming rule (:func:`condcomp.masks.streaming_allowed`)
reads the same at prefill and at every decode step. Keys are stored after rotary, at their own positions. A call
attends over the held entries and its own keys and trims the cache after it in one function,
:func:`attend_window` (the ``window`` policy's call on a growing cache; a static cache's ring is
:class:`~condcomp.kv.fixed_slots.RingWindow`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from condcomp.dense import grouped_sdpa
from condcomp.kv.position_bias import RelativeBias, biased_mask
from condcomp.masks import streaming_allowed
from condcomp.options import MAX_COUNT, Option, check_fields, count

_SINK_RANK = 1 << 48  # above any real position: sinks outrank every recent token when trimming
_MAX_TOKENS = MAX_COUNT  # sinks and windows beyond any context (and below _SINK_RANK): int64 positions stay exact
# the window's numbers, checked by the one option check (condcomp.options) for StreamWindow and the window policy
WINDOW_OPTIONS: tuple[Option, ...] = (
    count("sinks", at_most=_MAX_TOKENS, meaning="first tokens kept; kv='full' keeps every token"),
    count("window", at_least=1, at_most=_MAX_TOKENS, meaning="recent tokens kept; kv='full' keeps every token"),
    count("model_window", at_least=1, at_most=_MAX_TOKENS, optional=True, meaning="the model's own sliding window"),
)
# tokens at the end of a request's first call that a verifier may take back (set by the attachment, see below)
_FIRST_CALL_TAIL: contextvars.ContextVar[int] = contextvars.ContextVar("condcomp_first_call_tail", default=0)
# whether a request's first call holds its whole prompt (set by the attachment under plan_from_prompt, see below)
_PROMPT_COMPLETE: contextvars.ContextVar[bool] = contextvars.ContextVar("condcomp_prompt_complete", default=False)


@contextlib.contextmanager
def revertible_tail(tokens: int, prompt_complete: bool = False) -> Iterator[None]:
    """Inside the block, a request's first call (its prefill) keeps its last ``tokens`` tokens in the streamed
    groups' windows beyond what the window holds, until the next call, as a later call of several tokens does: they
    are candidates a verifier may take back (assisted decoding's first call is the prompt and its first candidates,
    and ``crop`` then rejects some). The attachment sets it to the tokens after the prompt under
    :func:`condcomp.plan_from_prompt`; 0 (the default) trims a prefill to the window. ``prompt_complete``: the
    call holds the whole prompt (``plan_from_prompt``'s width), so a later call of several tokens is a question or
    a new turn, not a second prompt chunk (:func:`first_call_completes_prompt`)."""
    token = _FIRST_CALL_TAIL.set(max(int(tokens), 0))
    complete = _PROMPT_COMPLETE.set(bool(prompt_complete))
    try:
        yield
    finally:
        _PROMPT_COMPLETE.reset(complete)
        _FIRST_CALL_TAIL.reset(token)


def first_call_tail() -> int:
    """The tokens a prefill keeps beyond the window now (:func:`revertible_tail`)."""
    return _FIRST_CALL_TAIL.get()


def first_call_completes_prompt() -> bool:
    """Whether the prefill now holds the request's whole prompt (:func:`revertible_tail`)."""
    return _PROMPT_COMPLETE.get()


@dataclass(frozen=True)
class StreamWindow:
    """What a streaming KV group keeps: the request's first ``sinks`` tokens plus its last ``window`` tokens.

    A query at position ``p`` of a streaming group attends to keys at positions ``j <= p`` with ``j < sinks`` or
    ``p - j < window`` (positions count the request's real tokens, padding excluded); the cache holds at most
    ``sinks + window`` tokens per streaming group, so its bytes stop growing with the context.

    ``model_window``: the model's own sliding window on this layer (Mistral's ``sliding_window``: a query reads keys
    ``p - j < model_window`` only), set by the attachment; a streaming group then reads what *both* rules allow, so
    it never sees a key its full group would not (:meth:`allowed`).

    >>> StreamWindow(sinks=4, window=60).capacity
    64
    >>> StreamWindow(sinks=1, window=6, model_window=3).capacity  # the recent band shrinks to the model's
    4
    """

    sinks: int = 4
    window: int = 64
    model_window: int | None = None

    options: ClassVar[tuple[Option, ...]] = WINDOW_OPTIONS

    def __post_init__(self) -> None:
        check_fields(self, "StreamWindow")

    @property
    def recent(self) -> int:
        """The recent band a query reads: ``window``, or the model's own window where that is narrower."""
        return self.window if self.model_window is None else min(self.window, self.model_window)

    @property
    def capacity(self) -> int:
        """Tokens a streaming group's cache holds at most (between calls of one token)."""
        return self.sinks + self.recent

    def allowed(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """``(B, T, S)``: the streaming rule (:func:`~condcomp.masks.streaming_allowed`) and, when set, the model's
        own window (sinks too are read only within it); ``query_pos (B, T)``, ``key_pos (B, S)``."""
        ok = streaming_allowed(query_pos, key_pos, self.sinks, self.recent)
        if self.model_window is None:
            return ok
        return ok & (query_pos.unsqueeze(-1) - key_pos.unsqueeze(-2) < self.model_window)


@dataclass(frozen=True)
class WindowCache:
    """Streamed groups of a batch: ``keys``/``values (B, gw, N, Dh)``, ``positions (B, N)`` (the real-token
    position of each entry, -1 = empty) and ``seen (B,)``, the real tokens each request has had so far."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    seen: Tensor

    def tensors(self) -> tuple[Tensor, ...]:
        """The four tensors held."""
        return self.keys, self.values, self.positions, self.seen

    @property
    def nbytes(self) -> int:
        """Bytes the four tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def take_rows(self, index: Tensor) -> WindowCache:
        """Rows ``index`` (int64 or bool over rows), in that order (beam reordering, selecting, repeating)."""
        i = index.to(self.keys.device)
        return WindowCache(self.keys[i], self.values[i], self.positions[i], self.seen[i])

    def crop(self, tokens: int, window: StreamWindow) -> WindowCache:
        """The cache without each request's last ``tokens`` tokens (their entries are emptied, the next call drops
        them); refused where a key the next query would read was already evicted (it cannot be brought back)."""
        positions, seen = crop_positions(self.positions, self.seen, tokens, window)
        return WindowCache(self.keys, self.values, positions, seen)


def crop_positions(positions: Tensor, seen: Tensor, tokens: int, window: StreamWindow) -> tuple[Tensor, Tensor]:
    """A window's ``(positions, seen)`` without each request's last ``tokens`` tokens (see :meth:`WindowCache.crop`;
    shared with the quantized window, whose entries stay where they are).

    ``tokens == 0`` changes nothing (assisted decoding crops 0 when every candidate was accepted); cropping every
    token a row holds empties it (a new request). Otherwise each row's next query, at position ``seen - tokens``,
    must find every earlier key its rule reads among the entries held: the sinks always are; the recent band is
    while the crop stays within what the window still holds (the last ``recent`` tokens, plus the tokens of the last
    call when it had more than one, which a verifier such as assisted decoding may take back)."""
    if tokens == 0:
        return positions, seen
    after = (seen - tokens).clamp_min(0)  # (B,): each row's tokens after the crop = its next query's position
    held = (positions >= 0) & (positions < after.unsqueeze(-1))  # (B, N)
    read_held = (held & window.allowed(after.unsqueeze(-1), positions).squeeze(1)).sum(-1)  # (B,)
    earlier = torch.arange(int(after.max()) if after.numel() else 0, device=positions.device)  # (P,)
    earlier = earlier.expand(after.shape[0], -1)  # (B, P)
    read = ((earlier < after.unsqueeze(-1)) & window.allowed(after.unsqueeze(-1), earlier).squeeze(1)).sum(-1)
    short = read_held < read  # (B,): rows whose next query would miss an evicted key
    if bool(short.any()):
        rows = short.nonzero().flatten().tolist()
        raise ValueError(
            f"cannot crop {tokens} token(s) from this KV cache: in row(s) {rows} its streamed groups already evicted "
            f"token(s) the next query would read (they hold the first {window.sinks} and the last {window.recent} "
            "tokens of each request, plus the tokens of the last call when it had several), and evicted tokens "
            "cannot be brought back. Crop only tokens the windows still hold, or crop the whole cache (or reset() "
            "it) and start the request again. Assisted decoding: generate inside condcomp.plan_from_prompt(model, "
            "prompt width), so its first call keeps the candidates after the prompt until they are verified")
    return positions.masked_fill(positions >= after.unsqueeze(-1), -1), after


def query_positions(seen: Tensor | None, query_mask: Tensor | None, B: int, T: int, device: torch.device) -> Tensor:
    """``(B, T)``: each query's real-token position in its request (``-1`` for padding), after ``seen`` tokens."""
    real = torch.ones(B, T, dtype=torch.bool, device=device) if query_mask is None else query_mask.bool()
    before = torch.zeros(B, dtype=torch.long, device=device) if seen is None else seen
    pos = before.unsqueeze(-1) + real.long().cumsum(-1) - 1  # (B, T)
    return pos.masked_fill(~real, -1)


def extend(state: WindowCache | None, keys: Tensor, values: Tensor, query_pos: Tensor
           ) -> tuple[Tensor, Tensor, Tensor]:
    """The held entries followed by this call's ``keys``/``values (B, gw, T, Dh)`` and their positions."""
    if state is None:
        return keys, values, query_pos
    return (torch.cat([state.keys, keys], 2), torch.cat([state.values, values], 2),
            torch.cat([state.positions, query_pos], 1))


def trim(keys: Tensor, values: Tensor, positions: Tensor, seen: Tensor, window: StreamWindow, slack: int = 0
         ) -> WindowCache:
    """Keep at most ``sinks + recent + slack`` entries per row: the sinks and the most recent tokens (what any later
    query may still attend, and ``slack`` more so a crop of that many tokens can be taken back), in position order;
    the rest is evicted."""
    N = positions.shape[1]
    keep = min(N, window.capacity + slack)
    if keep < N:
        # sinks rank first, then recent positions; empty entries (-1) last (no host read of the positions)
        score = torch.where((positions >= 0) & (positions < window.sinks), positions + _SINK_RANK, positions)
        chosen = score.topk(keep, dim=-1).indices  # (B, keep)
        kept = positions.gather(1, chosen)
        order = kept.masked_fill(kept < 0, _SINK_RANK).argsort(-1)
        chosen = chosen.gather(1, order)  # position order (empty entries last)
        keys, values, positions = take_entries(keys, chosen), take_entries(values, chosen), positions.gather(1, chosen)
    return WindowCache(keys, values, positions, seen)


def take_entries(t: Tensor, chosen: Tensor) -> Tensor:
    """``t (B, g, N, Dh)`` at each row's entries ``chosen (B, K)`` -> ``(B, g, K, Dh)``.

    One row copy of ``Dh`` values per entry (``index_select`` over the flattened entries): ``torch.gather`` with an
    index expanded over ``Dh`` runs element by element on CPU and cost a fifth of a decode step here (SmolLM2,
    batch 8, a 256-token window: 2 ms per call against 0.1 ms).
    """
    B, g, N, Dh = t.shape
    first = (torch.arange(B * g, device=t.device) * N).view(B, g, 1)  # each (row, group)'s first entry
    flat = (first + chosen.unsqueeze(1)).reshape(-1)  # (B*g*K,)
    return t.reshape(B * g * N, Dh).index_select(0, flat).view(B, g, chosen.shape[1], Dh)


Attend = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (q, k, v, mask) -> out, as grouped SDPA


def band_applies(query_mask: Tensor | None, T: int, window: StreamWindow) -> bool:
    """Whether a prefill of ``T`` tokens is computed block by block (:func:`banded_attention`): long enough for the
    band to save work (more than two windows), and every request's real tokens contiguous (no padding, or left
    padding), so the band of real positions is a band of indices."""
    if T <= 2 * window.capacity:
        return False
    if query_mask is None:
        return True
    real = query_mask.bool()
    return bool((real[:, 1:] >= real[:, :-1]).all())  # once real, real to the end


def banded_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, window: StreamWindow, attend: Attend,
                     bias: RelativeBias | None = None) -> Tensor:
    """The streaming rule's attention at a prefill, one block of ``window.recent`` queries at a time: each block
    reads its request's sink tokens and the keys of its own and the previous block, not all ``T`` keys. ``bias``:
    a relative position bias of ``q``'s heads (T5), added at each query's and key's true positions.

    ``q (B, Hq, T, Dh)``, ``k``/``v (B, Hkv, T, Dh)``, ``pos (B, T)`` real-token positions (``-1`` padding, which
    must come first in a row: :func:`band_applies`). Equals ``attend`` over all keys with the mask
    :meth:`StreamWindow.allowed` (padding queries get every key and are zeroed by the caller), at
    about ``2 * window / T`` of its cost.
    """
    B, _, T, _ = q.shape
    W, n_sinks = window.recent, window.sinks
    # each row's sink tokens (positions 0 .. sinks-1) by index; a row with fewer real tokens repeats an entry whose
    # position is set to -1 so it is never attended
    is_sink = (pos >= 0) & (pos < n_sinks)
    sink_idx = torch.where(is_sink, torch.arange(T, device=pos.device), T).sort(-1).values[:, :n_sinks]  # (B, s)
    sink_ok = sink_idx < T
    sink_idx = sink_idx.clamp_max(T - 1)
    sink_pos = pos.gather(1, sink_idx).masked_fill(~sink_ok, -1)  # (B, s)
    sink_k, sink_v = take_entries(k, sink_idx), take_entries(v, sink_idx)  # (B, Hkv, s, Dh)
    outs = []
    for start in range(0, T, W):
        end = min(start + W, T)
        lo = max(0, start - W + 1)  # the oldest key any query of the block may read in its band
        qp, kp = pos[:, start:end], pos[:, lo:end]
        local = window.allowed(qp, kp) & (kp >= n_sinks).unsqueeze(1)  # sinks come from sink_k
        allowed = torch.cat([window.allowed(qp, sink_pos), local], -1)  # (B, b, s + band)
        dead = ~allowed.any(-1, keepdim=True)
        keys = torch.cat([sink_k, k[:, :, lo:end]], 2)
        values = torch.cat([sink_v, v[:, :, lo:end]], 2)
        scores = None if bias is None else bias.at(qp, torch.cat([sink_pos, kp], -1))  # (B, Hq, b, s + band)
        outs.append(attend(q[:, :, start:end], keys, values,
                           biased_mask((allowed | dead).unsqueeze(1), scores, q.dtype)))
    return torch.cat(outs, 2)


def attend_window(q: Tensor, k: Tensor, v: Tensor, state: WindowCache | None, query_mask: Tensor | None,
                  scale: float, window: StreamWindow, keep: bool, bias: RelativeBias | None = None
                  ) -> tuple[Tensor, Tensor, WindowCache | None]:
    """One call of a streamed group's queries over its held entries and this call's keys, by the streaming rule
    (:meth:`StreamWindow.allowed`): ``q (B, gw*r, T, Dh)``, ``k``/``v (B, gw, T, Dh)`` after rotary, ``state``
    before the call (None at a request's first call), ``query_mask (B, T)`` real tokens or None, ``bias`` a
    relative position bias of ``q``'s heads (T5). Returns ``(out (B, gw*r, T, Dh), dead (B, 1, T) queries that see
    no key, the trimmed cache after the call or None if not keep)``."""
    B, _, T, _ = q.shape
    pos = query_positions(None if state is None else state.seen, query_mask, B, T, q.device)  # (B, T)
    keys, values, key_pos = extend(state, k, v, pos)
    if state is None and band_applies(query_mask, T, window):  # a long prefill: block by block
        dead = pos < 0  # (B, T): padding queries
        out = banded_attention(q, keys, values, pos, window,
                               lambda qb, kb, vb, m: grouped_sdpa(qb, kb, vb, m, False, scale), bias)
    else:
        allowed = window.allowed(pos, key_pos)  # (B, T, N)
        dead = ~allowed.any(-1)  # (B, T): padding queries
        scores = None if bias is None else bias.at(pos, key_pos)  # (B, gw*r, T, N)
        mask = biased_mask((allowed | dead.unsqueeze(-1)).unsqueeze(1), scores, q.dtype)
        out = grouped_sdpa(q, keys, values, mask, False, scale)
    if not keep:
        return out, dead.unsqueeze(1), None
    seen = (pos.amax(-1) + 1).clamp_min(0 if state is None else state.seen)  # (B,)
    # a later call of several tokens keeps them all until the next call: a verifier (assisted decoding) may crop them
    # again; a prefill is trimmed to the window (its bytes are what the window promises) but for the candidates after
    # the prompt it carries (assisted decoding's first call, see revertible_tail)
    slack = T - 1 if state is not None else min(first_call_tail(), T - 1)
    return out, dead.unsqueeze(1), trim(keys, values, key_pos, seen, window, slack=max(slack, 0))
