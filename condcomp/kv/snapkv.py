"""The ``snapkv`` KV policy: a group keeps the prompt tokens its last queries attend to most, then every new token.

SnapKV (Li et al., 2024): at the prefill, the last ``observe`` prompt tokens (the observation window) score every
earlier prompt token by the attention they pay it (softmax over the keys each query sees, summed over the window's
queries and the group's query heads), the scores are smoothed by an average pool of ``pool`` tokens (zero padded),
and the ``budget`` highest-scored earlier tokens are kept with the window itself (or, with ``fraction``, that share
of each request's prompt, window included, as kvpress's ``compression_ratio``). The prefill's own outputs attend to
the whole prompt; later tokens attend to what was kept plus every token after the prompt. Only the groups a plan
does not keep in full are compressed this way.

Its state (:class:`SnapState`, shared with :mod:`condcomp.kv.adakv`) holds each (row, group)'s kept prompt entries,
padded to the largest such count in the batch (empty entries: position -1), and grows by one entry per later token,
as a full group does. Inside a quantized cache (fp8, HQQ, quanto) the state's keys and values are stored by the
layer's own rule (:mod:`condcomp.kv.snap_quant`). On a static cache the prefill moves it into a region allocated
once (:class:`~condcomp.kv.fixed_slots.SlotRegion`: the selection, then room for every token to come)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.dense import grouped_sdpa
from condcomp.kv.fixed_slots import SlotRegion, refuse_position_bias
from condcomp.kv.policy import KVPolicy
from condcomp.kv.position_bias import RelativeBias, biased_mask, check_contiguous
from condcomp.kv.snap_quant import QuantizedSnapState
from condcomp.kv.window import first_call_completes_prompt, first_call_tail, query_positions
from condcomp.kv.window_quant import WindowCodec
from condcomp.options import Option, check_fields, count, real
from condcomp.registry import register_kv_policy


@dataclass(frozen=True)
class SnapState:
    """``keys``/``values (B, gw, N, Dh)``, ``positions (B, gw, N)`` (each group keeps its own tokens; -1 = empty),
    ``seen (B,)`` real tokens so far, ``prompt (B,)`` the real prompt tokens the selection was made from;
    ``prefill_only``: nothing happened since the prefill, which may not hold the whole prompt, so a call of several
    tokens may be another prompt chunk (refused); a crop (a verifier's) ends it, and a prefill inside
    ``condcomp.plan_from_prompt`` of the prompt's width never sets it (the caller said the prompt is complete)."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    seen: Tensor
    prompt: Tensor
    prefill_only: bool = False

    def take_rows(self, index: Tensor) -> SnapState:
        i = index.to(self.keys.device)
        return SnapState(self.keys[i], self.values[i], self.positions[i], self.seen[i], self.prompt[i],
                         self.prefill_only)

    def tensors(self) -> tuple[Tensor, ...]:
        return self.keys, self.values, self.positions, self.seen, self.prompt


def observation_scores(q: Tensor, k: Tensor, pos: Tensor, observed: Tensor, scored: Tensor, pool: int,
                       scale: float, bias: Tensor | None = None) -> Tensor:
    """SnapKV's score of every prompt token: the attention the observation window's queries ``observed (B, T)``
    pay it (softmax over the keys each query sees, summed over those queries and the group's heads), zero outside
    ``scored (B, T)``, average-pooled over ``pool`` tokens (zero padded); -1 outside ``scored``. ``q (B, gw*r, T,
    Dh)``, ``k (B, gw, T, Dh)``, ``pos (B, T)`` (-1: padding), ``bias (B, gw*r, T, T)`` the model's position bias
    on the scores (T5) or None. Returns ``(B, gw, T)`` in float32."""
    B, gw, T, Dh = k.shape
    r = q.shape[1] // max(gw, 1)
    logits = torch.einsum("bgrtd,bgsd->bgrts", q.float().view(B, gw, r, T, Dh), k.float()) * scale
    if bias is not None:  # the attention the model really pays: its scores with the position bias
        logits = logits + bias.float().view(B, gw, r, T, T)
    causal = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] >= 0)  # (B, T, S)
    attn = logits.masked_fill(~causal[:, None, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    scores = (attn * observed[:, None, None, :, None]).sum((2, 3))  # (B, gw, S): summed over heads, queries
    scores = scores * scored[:, None, :]
    pooled = F.avg_pool1d(scores.reshape(B * gw, 1, T), pool, 1, pool // 2).view(B, gw, T)
    return pooled.masked_fill(~scored[:, None, :], -1.0)


def best_per_group(scores: Tensor, budgets: Tensor) -> Tensor:
    """``(B, gw, T)`` bool: each (row, group)'s ``budgets (B,)`` highest ``scores (B, gw, T)`` among those >= 0."""
    ranked = scores.sort(-1, descending=True)
    within = torch.arange(scores.shape[-1], device=scores.device) < budgets[:, None, None]  # (B, 1, T)
    return torch.zeros_like(within.expand_as(scores)).scatter(-1, ranked.indices, within & (ranked.values >= 0))


def kept_state(k: Tensor, v: Tensor, pos: Tensor, kept: Tensor, prompt: Tensor, prefill_only: bool = True
               ) -> SnapState:
    """The state holding the prompt tokens ``kept (B, gw, T)`` of ``k``/``v (B, gw, T, Dh)``, in position order,
    padded to the largest count of a (row, group) with empty entries (position -1); ``prefill_only``: the prompt may
    go on in the next call (see :class:`SnapState`)."""
    B, gw, T, Dh = k.shape
    n = int(kept.sum(-1).max()) if kept.numel() else 0  # one host sync, at prefill
    token = torch.arange(T, device=k.device)
    idx = ((~kept).long() * T + token).argsort(-1)[..., :n]  # (B, gw, n): kept tokens first, in sequence order
    real = kept.gather(-1, idx)  # (B, gw, n)
    entry_pos = torch.where(real, pos.gather(1, idx.flatten(1)).view(B, gw, n), -1)
    flat = (torch.arange(B * gw, device=k.device) * T).view(B, gw, 1) + idx  # (B, gw, n)
    keys = k.reshape(B * gw * T, Dh).index_select(0, flat.reshape(-1)).view(B, gw, n, Dh)
    values = v.reshape(B * gw * T, Dh).index_select(0, flat.reshape(-1)).view(B, gw, n, Dh)
    return SnapState(keys, values, entry_pos, prompt, prompt, prefill_only=prefill_only)


def whole_share(count: Tensor, share: float) -> Tensor:
    """``floor(count * share)`` (int64), exact when the product is whole: in float64 0.29 * 100 is
    28.999999999999996, which a bare floor turns into 28; the relative slack (1e-12, far above float64's 1.1e-16
    rounding) keeps it 29."""
    return (count.double() * share * (1 + 1e-12)).floor().long()


def prompt_budgets(prompt: Tensor, window: Tensor, budget: int | None, fraction: float | None) -> Tensor:
    """``(B,)`` scored tokens each group keeps besides its ``window (B,)`` recent ones: ``budget``, or the
    ``fraction`` of each row's ``prompt (B,)`` real tokens less its window (none when the window alone reaches it)."""
    if fraction is None:
        return torch.full_like(prompt, 64 if budget is None else budget)
    return (whole_share(prompt, fraction) - window).clamp_min(0)


# the numbers of snapkv and adakv, checked by the one option check (condcomp.options) when either is built: a budget
# is bounded (2**40 tokens, beyond any prompt) so that budget x groups stays inside int64 (adakv's layer budget)
SNAP_OPTIONS: tuple[Option, ...] = (
    count("budget", optional=True, meaning="prompt tokens kept per group; kv='full' keeps every token"),
    count("observe", at_least=1, meaning="the last prompt queries that score the tokens"),
    count("pool", at_least=1, at_most=1 << 30, meaning="an odd pooling width; torch pools over 32-bit widths"),
    real("fraction", above=0, at_most=1, optional=True, meaning="of each prompt kept per group"),
)


def check_options(name: str, policy: Any) -> None:
    """Refuse bad ``budget`` / ``observe`` / ``pool`` / ``fraction`` options of ``snapkv`` and ``adakv``: each
    number by :data:`SNAP_OPTIONS`, then their relations."""
    check_fields(policy, f"{name} kv policy")
    if policy.pool % 2 == 0:
        raise ValueError(f"{name}: pool must be odd (a window centred on each token), got {policy.pool}")
    if policy.fraction is not None and policy.budget is not None:
        raise ValueError(f"{name}: give budget (tokens per group) or fraction (of the prompt), not both")


@register_kv_policy("snapkv")
@dataclass(frozen=True)
class SnapKV(KVPolicy):
    """Keep ``budget`` prompt tokens (64 if neither it nor ``fraction`` is given) chosen by the last ``observe``
    prompt queries (scores pooled over ``pool`` tokens) plus those ``observe`` tokens; every token after the prompt
    is kept. ``fraction``: instead of ``budget``, keep that fraction of each request's prompt tokens, the window
    included (kvpress's ``compression_ratio = 1 - fraction``; the window is kept whole even when it is more)."""

    budget: int | None = None
    observe: int = 16
    pool: int = 5
    fraction: float | None = None
    stores: ClassVar[str] = "own"
    options: ClassVar[tuple[Option, ...]] = SNAP_OPTIONS
    reads_slot_validity: ClassVar[bool] = True  # spare slots keep nothing
    reads_position_bias: ClassVar[bool] = True  # T5: scores and attention with each kept key's true-position bias
    holds_fixed_slots: ClassVar[bool] = True  # the selection plus a region for the tokens to come (fixed_slots)

    def __post_init__(self) -> None:
        check_options("snapkv", self)

    @property
    def recent(self) -> int:
        """The most recent prompt tokens every group keeps whole (the observation window)."""
        return self.observe

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, query_mask: Tensor | None, scale: float,
               keep: bool, slot_valid: Tensor | None = None, position_bias: RelativeBias | None = None,
               slot_groups: Tensor | None = None) -> tuple[Tensor, Tensor, Any]:
        T = q.shape[2]
        if position_bias is not None:
            check_contiguous(self.name, query_mask, state is None)
        tail = min(first_call_tail(), T - 1) if state is None else 0
        if tail <= 0:
            return self._attend(q, k, v, state, query_mask, scale, keep, slot_valid, False, position_bias,
                                slot_groups)
        # a first call that carries tokens after the prompt (assisted decoding's candidates, revertible_tail): the
        # prompt is compressed on its own observation window, then the tail is a later call on it, as when
        # decoded one by one (and a verifier can take it back)
        P = T - tail
        head_mask, tail_mask = (None, None) if query_mask is None else (query_mask[:, :P], query_mask[:, P:])
        out, dead, prompt = self._attend(q[:, :, :P], k[:, :, :P], v[:, :, :P], None, head_mask, scale, True,
                                         slot_valid, False, position_bias, slot_groups)
        out2, dead2, new = self._attend(q[:, :, P:], k[:, :, P:], v[:, :, P:], prompt, tail_mask, scale, keep,
                                        slot_valid, True, position_bias, slot_groups)
        return torch.cat([out, out2], 2), torch.cat([dead, dead2], -1), new

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, query_mask: Tensor | None, scale: float,
                keep: bool, slot_valid: Tensor | None, after_prompt: bool,
                position_bias: RelativeBias | None, slot_groups: Tensor | None = None) -> tuple[Tensor, Tensor, Any]:
        B, H, T, _ = q.shape
        gw = k.shape[1]
        if state is not None and T > 1 and not after_prompt and state.prefill_only and (
                not isinstance(state, SlotRegion) or bool((state.seen == state.prompt).all())):
            # (a preallocated region is written in place: nothing happened since the prefill while seen = prompt)
            # a second prompt chunk (generate's prefill_chunk_size): the first chunk was compressed on its own
            # observation window and this one would be kept whole, which is not SnapKV's rule
            raise ValueError(f"{self.name}: the prompt must be prefilled in one call (a chunked prefill compresses "
                             "only its first chunk), and this call of several tokens right after the prefill may be "
                             "a second chunk; drop prefill_chunk_size, or pick another KV policy. If the prompt was "
                             "complete (this call is a question or a new turn), prefill it inside "
                             "condcomp.plan_from_prompt(model, width) with width at most the prefill's own (the "
                             "padded prompt width; a wider one says the prompt goes on, as a chunked prefill's does)")
        if isinstance(state, SlotRegion):  # a static cache: every token appended in place
            if position_bias is not None:
                refuse_position_bias(self.name)
            out, dead = state.attend(q, k, v, query_mask, scale)
            return out, dead, state
        pos = query_positions(None if state is None else state.seen, query_mask, B, T, q.device)  # (B, T)
        key_pos = pos[:, None, :].expand(B, gw, T)  # (B, gw, T)
        if state is not None:
            k, v = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)  # (B, gw, N + T, Dh)
            key_pos = torch.cat([state.positions, key_pos], 2)
        allowed = (key_pos[:, :, None, :] >= 0) & (key_pos[:, :, None, :] <= pos[:, None, :, None])  # (B, gw, T, N)
        dead = ~allowed.any(-1).any(1)  # (B, T): padding queries (a real one sees itself in every group)
        mask = (allowed | dead[:, None, :, None]).repeat_interleave(H // max(gw, 1), dim=1)  # (B, H, T, N)
        bias = None if position_bias is None else position_bias.at(pos, key_pos)  # (B, H, T, N)
        out = grouped_sdpa(q, k, v, biased_mask(mask, bias, q.dtype), False, scale)
        if not keep:
            return out, dead.unsqueeze(1), None
        seen = (pos.amax(-1) + 1).clamp_min(0 if state is None else state.seen)  # (B,)
        if state is not None:  # after the prompt: every token is kept
            return out, dead.unsqueeze(1), SnapState(k, v, key_pos, seen, state.prompt)
        if query_mask is not None and not bool((query_mask[:, 1:] >= query_mask[:, :-1]).all()):
            raise ValueError(f"{self.name}: a prompt with right padding (or holes) cannot be compressed: its "
                             "observation window is its last real tokens; pad prompts on the left (tokenizer "
                             "padding_side='left')")
        valid = torch.ones(B, gw, dtype=torch.bool, device=k.device) if slot_valid is None else slot_valid
        # a spare slot (it repeats a group of a row holding fewer of the policy's groups, at gate 0) keeps nothing,
        # so the state is padded to what the held groups keep, not to a spare slot's own selection
        kept = self._prompt_kept(q, k, pos, seen, scale, bias, valid.to(k.device), slot_groups)  # (B, gw, T)
        # the prompt may go on in the next call unless the caller said this call holds all of it (plan_from_prompt)
        return out, dead.unsqueeze(1), kept_state(k, v, pos, kept, seen, not first_call_completes_prompt())

    def _prompt_kept(self, q: Tensor, k: Tensor, pos: Tensor, seen: Tensor, scale: float, bias: Tensor | None,
                     valid: Tensor, slot_groups: Tensor | None) -> Tensor:
        """``(B, gw, T)`` bool: the prompt tokens each valid slot keeps (``pos (B, T)``, -1: padding; ``seen (B,)``
        the real prompt tokens): the ``recent`` ones and the scored ones :meth:`_choose` picks."""
        observed = (pos >= (seen - self.observe).unsqueeze(-1)) & (pos >= 0)  # (B, T): the window's queries
        recent = (pos >= (seen - self.recent).unsqueeze(-1)) & (pos >= 0)  # (B, T): kept whole
        scores = observation_scores(q, k, pos, observed, (pos >= 0) & ~recent, self.pool, scale, bias)  # (B, gw, T)
        budgets = prompt_budgets(seen, recent.sum(-1), self.budget, self.fraction)  # (B,)
        chosen = self._choose(scores, budgets, valid)
        return (chosen | recent[:, None, :]) & valid[:, :, None]

    def keys_read(self, state: Any, T: int, S: int) -> int:
        # the prefill attends the whole prompt; later calls the kept entries (padded: computed too) and their own
        if isinstance(state, SlotRegion):  # the whole region is read (its empty slots masked)
            return int(state.keys.shape[2]) + (T if T > 1 else 0)
        return S if state is None else int(state.keys.shape[2]) + T

    def _choose(self, scores: Tensor, budgets: Tensor, slot_valid: Tensor) -> Tensor:
        """``(B, gw, T)`` bool: the scored prompt tokens each group keeps: its own ``budgets (B,)`` best."""
        return best_per_group(scores, budgets)

    def crop(self, state: Any, tokens: int) -> Any:
        seen = state.seen - tokens  # (B,)
        if bool((seen < state.prompt).any()):
            raise ValueError(f"{self.name}: cannot crop {tokens} token(s) into the prompt its groups were compressed "
                             "from (the evicted prompt tokens cannot come back): start the request again. Assisted "
                             "decoding: generate inside condcomp.plan_from_prompt(model, prompt width), so its first "
                             "call compresses the prompt alone and keeps the candidates after it")
        if isinstance(state, SlotRegion):
            return state.crop(tokens)
        positions = state.positions.masked_fill(state.positions >= seen[:, None, None], -1)
        # a verifier's: no more chunks (a quantized state keeps its codes)
        return dataclasses.replace(state, positions=positions, seen=seen, prefill_only=False)

    def fixed_slots(self, state: Any, room: int) -> Any:
        return SlotRegion.from_state(state.keys, state.values, state.positions, state.seen, state.prompt, room,
                                     state.prefill_only)

    def stored(self, state: Any, codec: Any, before: Any) -> Any:
        if not isinstance(codec, WindowCodec) or not isinstance(state, SnapState):
            return state
        return QuantizedSnapState.store(state, codec, before if isinstance(before, QuantizedSnapState) else None)

    def loaded(self, stored: Any) -> Any:
        return stored.dequantized(SnapState) if isinstance(stored, QuantizedSnapState) else stored
