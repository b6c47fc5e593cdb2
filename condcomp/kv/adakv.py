"""The ``adakv`` KV policy: one token budget per layer and request, shared by its groups by score (AdaKV).

AdaKV (Feng et al., 2024) over SnapKV's scores (:mod:`condcomp.kv.snapkv`): at the prefill, the last ``observe``
prompt queries score every earlier prompt token per KV group (summed attention, average-pooled over ``pool``
tokens). Each request's layer has ``budget`` tokens per group it holds, ``budget x groups`` in all; every group
first gets its own ``floor x budget`` best tokens (AdaKV's safeguard, kvpress's ``alpha_safeguard``), and the rest
of the layer's budget goes to the highest scores over all its groups together, so a group whose attention is
spread keeps more tokens than one whose attention is peaked. Each group also keeps its last ``window`` prompt
tokens (the observation window when None) and every token after the prompt.

Groups keep different counts: the state (:class:`~condcomp.kv.snapkv.SnapState`) is padded to the largest
(row, group) count with empty entries (position -1), so its bytes are what that largest group holds, not the
prompt (``cache_bytes`` counts the padded tensors). Choosing across a row's groups needs to know which of the
policy's slots hold a group of that row (:attr:`~condcomp.kv.selection.KVSelection.window_valid`): the policy sets
``reads_slot_validity`` and the executor passes ``slot_valid``; spare slots get no share of the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from condcomp.kv.snapkv import SNAP_OPTIONS, SnapKV, best_per_group, check_options, whole_share
from condcomp.options import Option, count, real
from condcomp.registry import register_kv_policy


@register_kv_policy("adakv")
@dataclass(frozen=True)
class AdaKV(SnapKV):
    """``budget`` prompt tokens per held group on average (64 if neither it nor ``fraction`` is given), shared by
    score over a request's groups in the layer, each group guaranteed its ``floor`` share; ``window`` recent prompt
    tokens kept whole (None: the ``observe`` tokens). ``fraction``: instead of ``budget``, that share of each
    request's prompt per group on average, the window included.

    >>> AdaKV(budget=32, observe=8).recent
    8
    """

    window: int | None = None
    floor: float = 0.2
    options: ClassVar[tuple[Option, ...]] = (
        *SNAP_OPTIONS,
        count("window", optional=True, meaning="recent prompt tokens kept whole; None: observe"),
        real("floor", at_least=0, at_most=1, meaning="each group's guaranteed share of the budget"),
    )

    def __post_init__(self) -> None:
        check_options("adakv", self)

    @property
    def recent(self) -> int:
        return self.observe if self.window is None else self.window

    def _choose(self, scores: Tensor, budgets: Tensor, slot_valid: Tensor) -> Tensor:
        """``(B, gw, T)`` bool: ``budgets (B,)`` times a row's held groups, the ``floor`` share of each group's own
        best first, the rest by score over all its groups."""
        B, gw, T = scores.shape
        scores = scores.masked_fill(~slot_valid[:, :, None], -1.0)  # spare slots choose nothing
        own = best_per_group(scores, whole_share(budgets, self.floor))  # (B, gw, T): guaranteed
        joint = torch.where(own, torch.full_like(scores, float("inf")), scores).view(B, gw * T)
        ranked = joint.sort(-1, descending=True)
        total = budgets * slot_valid.sum(-1)  # (B,): the layer's budget of the row
        within = (torch.arange(gw * T, device=scores.device) < total[:, None]) & (ranked.values >= 0)
        return torch.zeros_like(within).scatter(-1, ranked.indices, within).view(B, gw, T)
