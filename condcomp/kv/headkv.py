"""The ``headkv`` KV policy: each KV group keeps its own share of the prompt (HeadKV's per-head budgets).

HeadKV (Fu et al., "Not All Heads Matter", ICLR 2025) gives every head its own token budget from an importance
score. Here the budget is a share of each request's prompt per KV group of the layer (``shares``; the allocation
over a whole model from one byte budget is :func:`condcomp.kv.headkv_budget.allocate_group_budgets`). A group with
share ``s`` keeps ``n = floor(s * prompt)`` prompt tokens: its first ``sinks`` tokens, its last ``window`` (the
``observe`` window when None; ``select="window"``: every token not a sink), and the rest by SnapKV's scores (the
last ``observe`` prompt queries' attention, summed over the group's heads, average-pooled over ``pool`` tokens, as
:mod:`condcomp.kv.snapkv`). A small share is therefore a small streaming window, a larger one adds selected tokens.
Every token after the prompt is kept, as ``snapkv`` does.

The state is :class:`~condcomp.kv.snapkv.SnapState`, padded to the largest count of the layer's held groups (empty
entries at position -1): ``cache_bytes`` counts the padded tensors, and the allocation counts the padding. Inside a
quantized cache (fp8, HQQ, quanto) it is stored by the layer's own rule, as ``snapkv``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.kv.snapkv import SNAP_OPTIONS, SnapKV, check_options, observation_scores
from condcomp.options import Option, count
from condcomp.registry import register_kv_policy

SELECT_RULES = ("snapkv", "window")


def _shares_problem(shares: tuple[object, ...]) -> str | None:
    for g, s in enumerate(shares):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            return f"share {g} is {s!r}, not a number"
        if not math.isfinite(float(s)) or not 0.0 < float(s) <= 1.0:
            return f"share {g} is {s!r}, outside (0, 1]"
    return None


@register_kv_policy("headkv")
@dataclass(frozen=True)
class HeadKV(SnapKV):
    """Each held KV group keeps ``shares[g]`` of each request's prompt (group ``g`` of the layer): its ``sinks``
    first tokens, its ``window`` last (None: ``observe``), the rest chosen by ``select`` (``"snapkv"``: SnapKV's
    scores from the last ``observe`` queries, pooled over ``pool``; ``"window"``: the most recent). Without
    ``shares`` every group keeps ``fraction`` of its prompt, or ``budget`` scored tokens (64 if None) beside its
    sinks and window.

    >>> HeadKV(shares=(0.5, 0.125), sinks=4).shares
    (0.5, 0.125)
    """

    shares: tuple[float, ...] = ()
    sinks: int = 4
    window: int | None = None
    select: str = "snapkv"
    options: ClassVar[tuple[Option, ...]] = (
        *SNAP_OPTIONS,
        count("sinks", meaning="first prompt tokens every held group keeps"),
        count("window", optional=True, meaning="last prompt tokens every held group keeps whole; None: observe"),
    )
    reads_slot_groups: ClassVar[bool] = True  # each slot's share is its group's

    def __post_init__(self) -> None:
        check_options("headkv", self)
        shares = tuple(self.shares) if isinstance(self.shares, (list, tuple)) else None
        if shares is None:
            raise ValueError(f"headkv: shares must be a list of numbers, one per KV group of the layer, got "
                             f"{self.shares!r}")
        why = _shares_problem(shares)
        if why is not None:
            raise ValueError(f"headkv: shares (of each prompt kept per KV group) must each be a finite number in "
                             f"(0, 1]: {why}. A group kept whole is the plan's (the router's), not the policy's")
        object.__setattr__(self, "shares", tuple(float(s) for s in shares))
        if self.select not in SELECT_RULES:
            raise ValueError(f"headkv: select must be one of {', '.join(SELECT_RULES)} (how a group's tokens beyond "
                             f"its sinks and window are chosen), got {self.select!r}")
        if self.shares and (self.budget is not None or self.fraction is not None):
            raise ValueError("headkv: give shares (one per KV group) or one budget / fraction for every group, "
                             "not both")

    @property
    def recent(self) -> int:
        return self.observe if self.window is None else self.window

    def check_layout(self, num_kv_groups: int) -> None:
        if self.shares and len(self.shares) != num_kv_groups:
            raise ValueError(f"headkv: shares gives {len(self.shares)} KV group(s) for a layer of {num_kv_groups}: "
                             "pass one share per KV group of the layer (headkv_split does)")

    def _counts(self, seen: Tensor, slot_groups: Tensor | None, B: int, gw: int) -> Tensor:
        """``(B, gw)`` int64: prompt tokens each slot keeps, at most its row's ``seen (B,)``."""
        if not self.shares:
            if self.fraction is not None:
                n = (seen.double() * self.fraction * (1 + 1e-12)).floor().long()  # as snapkv's whole_share
            else:
                n = seen.clamp_max(self.sinks + self.recent + (64 if self.budget is None else self.budget))
            return n[:, None].expand(B, gw).clamp(max=seen[:, None])
        if slot_groups is None:
            raise ValueError("headkv: per-group shares need the KV group of each slot (slot_groups); it runs under "
                             "the kv_cache executor, which passes them")
        top = int(slot_groups.max()) if slot_groups.numel() else -1  # one host sync, at the prefill
        if top >= len(self.shares):
            raise ValueError(f"headkv: shares gives {len(self.shares)} KV group(s), and this layer holds group {top}: "
                             "pass one share per KV group of the layer (headkv_split does)")
        table = torch.tensor(self.shares, dtype=torch.float64, device=seen.device)
        share = table[slot_groups.to(seen.device)]  # (B, gw)
        n = (seen[:, None].double() * share * (1 + 1e-12)).floor().long()  # exact when the product is whole
        return torch.minimum(n, seen[:, None])

    def _prompt_kept(self, q: Tensor, k: Tensor, pos: Tensor, seen: Tensor, scale: float, bias: Tensor | None,
                     valid: Tensor, slot_groups: Tensor | None) -> Tensor:
        B, gw, T, _ = k.shape
        n = self._counts(seen, slot_groups, B, gw)[:, :, None]  # (B, gw, 1)
        sinks = n.clamp(max=self.sinks)
        recent = (n - sinks) if self.select == "window" else (n - sinks).clamp(max=self.recent)
        real = (pos >= 0)[:, None, :]  # (B, 1, T)
        p = pos[:, None, :]
        sink = real & (p < sinks)  # (B, gw, T)
        tail = real & (p >= seen[:, None, None] - recent)
        kept = sink | tail
        picks = n - sinks - recent  # (B, gw, 1): tokens chosen by score
        if self.select == "snapkv" and bool((picks > 0).any()):
            observed = (pos >= (seen - self.observe).unsqueeze(-1)) & (pos >= 0)  # (B, T): the window's queries
            raw = observation_scores(q, k, pos, observed, pos >= 0, 1, scale, bias)  # (B, gw, T), unpooled
            candidate = real & ~kept  # (B, gw, T): neither sink nor recent
            x = (raw.clamp_min(0) * candidate).reshape(B * gw, 1, T)  # zeroed outside, as snapkv's window
            pooled = F.avg_pool1d(x, self.pool, 1, self.pool // 2).view(B, gw, T).masked_fill(~candidate, -1.0)
            ranked = pooled.sort(-1, descending=True)
            within = (torch.arange(T, device=k.device) < picks) & (ranked.values >= 0)  # (B, gw, T)
            kept = kept | torch.zeros_like(within).scatter(-1, ranked.indices, within)
        return kept & valid[:, :, None]
