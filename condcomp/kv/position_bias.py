"""A per-head score bias that depends only on how far back a key is from its query (T5's relative position bias).

A KV policy that keeps a group's tokens in a state of its own (``window``, ``snapkv``, ``adakv``) reads keys by
their true positions, not by where they sit in the full cache: a model that adds a relative position bias to its
scores (T5) hands the policy this table, and the policy adds, for each query and kept key, the bias of their true
distance. A decoder's bias is causal: distance ``d = query position - key position >= 0`` (keys after the query are
masked, whatever their bias); distances beyond the table's last entry get that entry (T5's buckets saturate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RelativeBias:
    """``table (B|1, H, D)``: head ``h``'s bias for a key ``d`` tokens before its query (``d < D``; farther keys
    get ``table[..., D - 1]``). Built by :meth:`from_scores`; :meth:`for_heads` narrows it to a policy's slots."""

    table: Tensor

    @classmethod
    def from_scores(cls, bias: Tensor, last_query: int | Tensor) -> RelativeBias:
        """The table of a dense bias ``(B|1, H, T, S)`` that depends only on ``key index - query index`` (T5's
        ``compute_bias``), whose last query sits at cache index ``last_query``: its row over the keys before it,
        read backwards, gives every distance ``0 .. last_query``. ``last_query`` may be a device scalar (a static
        cache's count): the table then has ``S`` entries, gathered on the device (no host read, a shape that does not
        change from step to step, as a compiled decode step needs); entries past ``last_query`` repeat the bias of
        distance ``last_query`` (no real key is farther)."""
        if isinstance(last_query, Tensor):
            if bias.dim() != 4:
                raise ValueError(f"a relative position bias (B|1, H, T, S) is needed, got shape {tuple(bias.shape)}")
            back = (last_query - torch.arange(bias.shape[-1], device=bias.device)).clamp_min(0)  # (S,)
            return cls(bias[:, :, -1, :].index_select(-1, back))  # (B|1, H, S)
        if bias.dim() != 4 or bias.shape[-1] <= last_query:
            raise ValueError(f"a relative position bias (B|1, H, T, S) with S > {last_query} (the last query's "
                             f"index) is needed, got shape {tuple(bias.shape)}")
        return cls(bias[:, :, -1, :last_query + 1].flip(-1))  # (B|1, H, last_query + 1)

    def for_heads(self, heads: Tensor) -> RelativeBias:
        """The table of the query heads ``heads (B, m)`` (a policy's slots, in its order): ``(B, m, D)``."""
        B, m = heads.shape
        table = self.table.expand(B, *self.table.shape[1:])
        return RelativeBias(table.gather(1, heads[:, :, None].expand(B, m, table.shape[2])))

    def at(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """``(B, m, T, N)``: the bias of queries at ``query_pos (B, T)`` and keys at ``key_pos`` ``(B, N)`` (shared
        by every head) or ``(B, g, N)`` (one row per group of ``m / g`` heads), on a table narrowed to ``m``
        heads. Positions count each request's real tokens (-1: padding or an empty entry: masked by the caller)."""
        B, m, D = self.table.shape
        T = query_pos.shape[1]
        if key_pos.dim() == 2:
            key_pos = key_pos[:, None, :]  # (B, 1, N)
        per_group = m // key_pos.shape[1]
        distance = (query_pos[:, None, :, None] - key_pos[:, :, None, :]).clamp(0, D - 1)  # (B, g, T, N)
        distance = distance.repeat_interleave(per_group, 1) if per_group > 1 else distance  # (B, m, T, N)
        N = distance.shape[-1]
        return self.table.gather(2, distance.reshape(B, m, T * N)).view(B, m, T, N)


def biased_mask(allowed: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """What SDPA adds to the scores: ``allowed`` (bool, broadcast to the bias) as is without a bias, else the bias
    where allowed and ``-inf`` elsewhere, in ``dtype``."""
    if bias is None:
        return allowed
    return bias.to(dtype).masked_fill(~allowed, float("-inf"))


def check_contiguous(name: str, query_mask: Tensor | None, first_call: bool) -> None:
    """Refuse padding inside a request under a relative position bias: the model measures distances in cache
    indices, the policy in real tokens, which agree only while each row's real tokens are contiguous (left padding
    at its first call, none later)."""
    if query_mask is None:
        return
    real = query_mask.bool()
    if bool((real[:, 1:] >= real[:, :-1]).all()) if first_call else bool(real.all()):
        return
    raise ValueError(f"{name}: a model with a relative position bias (T5) measures a key's distance in cache "
                     "indices, and this call puts padding between a request's real tokens (right padding, or padding "
                     "after the first call), where that distance is not the real tokens' one. Pad prompts on the "
                     "left (padding_side='left') and pass later calls without padding")
