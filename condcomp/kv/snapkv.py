"""The ``snapkv`` KV policy: a group keeps the prompt tokens its last queries attend to most, then every new token.

SnapKV (Li et al., 2024): at the prefill, the last ``observe`` prompt tokens (the observation window) score every
earlier prompt token by the attention they pay it (softmax over the keys each query sees, summed over the window's
queries and the group's query heads), the scores are smoothed by an average pool of ``pool`` tokens (zero padded),
and the ``budget`` highest-scored earlier tokens are kept with the window itself. The prefill's own outputs attend to
the whole prompt; later tokens attend to what was kept plus every token after the prompt. Only the groups a plan
does not keep in full are compressed this way.

Its state holds ``budget + observe`` prompt entries per row (fewer real ones in a shorter prompt: position -1) and
grows by one entry per later token, as a full group does. Inside a quantized cache (fp8, HQQ, quanto) the state stays
in full precision (``cache_bytes`` counts it so); a static cache cannot hold it (use the default ``DynamicCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.dense import grouped_sdpa
from condcomp.kv.policy import KVPolicy
from condcomp.kv.window import first_call_tail, query_positions
from condcomp.registry import register_kv_policy


@dataclass(frozen=True)
class SnapState:
    """``keys``/``values (B, gw, N, Dh)``, ``positions (B, gw, N)`` (each group keeps its own tokens; -1 = empty),
    ``seen (B,)`` real tokens so far, ``prompt (B,)`` the real prompt tokens the selection was made from;
    ``prefill_only``: nothing happened since the prefill, so a call of several tokens is another prompt chunk
    (refused); a crop (a verifier's) ends it."""

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


@register_kv_policy("snapkv")
@dataclass(frozen=True)
class SnapKV(KVPolicy):
    """Keep ``budget`` prompt tokens chosen by the last ``observe`` prompt queries (scores pooled over ``pool``
    tokens) plus those ``observe`` tokens; every token after the prompt is kept."""

    budget: int = 64
    observe: int = 16
    pool: int = 5
    stores: ClassVar[str] = "own"

    def __post_init__(self) -> None:
        for name, low in (("budget", 0), ("observe", 1), ("pool", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"snapkv: {name} must be an int >= {low}, got {v!r}")
        if self.pool % 2 == 0:
            raise ValueError(f"snapkv: pool must be odd (a window centred on each token), got {self.pool}")

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, query_mask: Tensor | None, scale: float,
               keep: bool) -> tuple[Tensor, Tensor, Any]:
        T = q.shape[2]
        tail = min(first_call_tail(), T - 1) if state is None else 0
        if tail <= 0:
            return self._attend(q, k, v, state, query_mask, scale, keep, False)
        # a first call that carries tokens after the prompt (assisted decoding's candidates, revertible_tail): the
        # prompt is compressed on its own observation window, then the tail is a later call on it, as when
        # decoded one by one (and a verifier can take it back)
        P = T - tail
        head_mask, tail_mask = (None, None) if query_mask is None else (query_mask[:, :P], query_mask[:, P:])
        out, dead, prompt = self._attend(q[:, :, :P], k[:, :, :P], v[:, :, :P], None, head_mask, scale, True, False)
        out2, dead2, new = self._attend(q[:, :, P:], k[:, :, P:], v[:, :, P:], prompt, tail_mask, scale, keep, True)
        return torch.cat([out, out2], 2), torch.cat([dead, dead2], -1), new

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, query_mask: Tensor | None, scale: float,
                keep: bool, after_prompt: bool) -> tuple[Tensor, Tensor, Any]:
        B, H, T, _ = q.shape
        gw = k.shape[1]
        if state is not None and T > 1 and not after_prompt and state.prefill_only:
            # a second prompt chunk (generate's prefill_chunk_size): the first chunk was compressed on its own
            # observation window and this one would be kept whole, which is not SnapKV's rule
            raise ValueError("snapkv: the prompt must be prefilled in one call (a chunked prefill compresses only "
                             "its first chunk); drop prefill_chunk_size, or pick another KV policy")
        pos = query_positions(None if state is None else state.seen, query_mask, B, T, q.device)  # (B, T)
        key_pos = pos[:, None, :].expand(B, gw, T)  # (B, gw, T)
        if state is not None:
            k, v = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)  # (B, gw, N + T, Dh)
            key_pos = torch.cat([state.positions, key_pos], 2)
        allowed = (key_pos[:, :, None, :] >= 0) & (key_pos[:, :, None, :] <= pos[:, None, :, None])  # (B, gw, T, N)
        dead = ~allowed.any(-1).any(1)  # (B, T): padding queries (a real one sees itself in every group)
        mask = (allowed | dead[:, None, :, None]).repeat_interleave(H // max(gw, 1), dim=1)  # (B, H, T, N)
        out = grouped_sdpa(q, k, v, mask, False, scale)
        if not keep:
            return out, dead.unsqueeze(1), None
        seen = (pos.amax(-1) + 1).clamp_min(0 if state is None else state.seen)  # (B,)
        if state is not None:  # after the prompt: every token is kept
            return out, dead.unsqueeze(1), SnapState(k, v, key_pos, seen, state.prompt)
        if query_mask is not None and not bool((query_mask[:, 1:] >= query_mask[:, :-1]).all()):
            raise ValueError("snapkv: a prompt with right padding (or holes) cannot be compressed: its observation "
                             "window is its last real tokens; pad prompts on the left (tokenizer padding_side='left')")
        return out, dead.unsqueeze(1), self._select(q, k, v, pos, seen, scale)

    def crop(self, state: Any, tokens: int) -> Any:
        seen = state.seen - tokens  # (B,)
        if bool((seen < state.prompt).any()):
            raise ValueError(f"snapkv: cannot crop {tokens} token(s) into the prompt its groups were compressed from "
                             "(the evicted prompt tokens cannot come back): start the request again. Assisted "
                             "decoding: generate inside condcomp.plan_from_prompt(model, prompt width), so its first "
                             "call compresses the prompt alone and keeps the candidates after it")
        positions = state.positions.masked_fill(state.positions >= seen[:, None, None], -1)
        return SnapState(state.keys, state.values, positions, seen, state.prompt)  # a verifier's: no more chunks

    def _select(self, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, prompt: Tensor, scale: float) -> SnapState:
        """The prompt's kept entries: ``q (B, gw*r, T, Dh)``, ``k``/``v (B, gw, T, Dh)``, ``pos (B, T)``."""
        B, gw, T, Dh = k.shape
        r = q.shape[1] // max(gw, 1)
        observed = (pos >= (prompt - self.observe).unsqueeze(-1)) & (pos >= 0)  # (B, T): the window's queries
        prefix = (pos >= 0) & ~observed  # (B, T): the tokens scored
        logits = torch.einsum("bgrtd,bgsd->bgrts", q.float().view(B, gw, r, T, Dh), k.float()) * scale
        causal = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] >= 0)  # (B, T, S)
        attn = logits.masked_fill(~causal[:, None, None], float("-inf")).softmax(-1).nan_to_num(0.0)
        scores = (attn * observed[:, None, None, :, None]).sum((2, 3))  # (B, gw, S): summed over heads, queries
        scores = scores * prefix[:, None, :]
        pooled = F.avg_pool1d(scores.reshape(B * gw, 1, T), self.pool, 1, self.pool // 2).view(B, gw, T)
        keep = min(self.budget, T)
        ranked = pooled.masked_fill(~prefix[:, None, :], -1.0).topk(keep, -1)  # (B, gw, keep)
        chosen_pos = torch.where(ranked.values >= 0, pos.gather(1, ranked.indices.flatten(1)).view(B, gw, keep), -1)
        window = min(self.observe, T)
        window_idx = torch.arange(T - window, T, device=k.device).expand(B, window)  # real tokens end each row
        window_pos = pos[:, T - window:].masked_fill(~observed[:, T - window:], -1)  # (B, window)
        # one entry list per (row, group): the chosen prefix tokens, then the window, in position order
        idx = torch.cat([ranked.indices, window_idx[:, None].expand(B, gw, window)], -1)  # (B, gw, n)
        entry_pos = torch.cat([chosen_pos, window_pos[:, None].expand(B, gw, window)], -1)
        order = entry_pos.masked_fill(entry_pos < 0, 1 << 48).argsort(-1)
        idx, entry_pos = idx.gather(-1, order), entry_pos.gather(-1, order)
        flat = (torch.arange(B * gw, device=k.device) * T).view(B, gw, 1) + idx  # (B, gw, n)
        keys = k.reshape(B * gw * T, Dh).index_select(0, flat.reshape(-1)).view(B, gw, -1, Dh)
        values = v.reshape(B * gw * T, Dh).index_select(0, flat.reshape(-1)).view(B, gw, -1, Dh)
        return SnapState(keys, values, entry_pos, prompt, prompt, prefill_only=True)
