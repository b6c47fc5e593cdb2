"""Per-group KV budgets from one byte budget (HeadKV-style): which (layer, KV group) pairs keep the full cache,
which a share of the prompt under the ``headkv`` KV policy, and which a small window.

The rule (:func:`allocate_group_budgets`), for importance scores ``s (L, G)`` (DuoAttention's gates, or any score
where higher means the group needs more of its context) and a budget of ``fraction`` of the dense cache's bytes:

1. importance ``w = max(s - s0, 0)`` with ``s0`` the smallest score (or ``score_floor``), normalised to sum 1
   (all equal: every group the same);
2. every group gets the ``floor`` share of the prompt, and a pool ``p`` is shared in proportion to ``w``:
   ``share = min(1, floor + p * w)``; a group whose share reaches 1 keeps the full cache (the plan's full groups,
   held by the router), the others are held by ``headkv`` with their share;
3. ``p`` is the largest pool whose bytes fit the budget (by bisection between the pools at which a group turns
   full), the bytes counted as they are stored: a full group costs 1 (its prompt); the layer's other groups are
   padded to the largest of their shares (``headkv``'s state is one tensor per layer), each entry
   ``1 + entry_overhead`` (its position, int64); a layer with no full group adds its token-counting placeholder
   (``empty_layer``);
4. once every group of some importance keeps the full cache, the pool cannot grow: the budget left is shared
   equally by the groups of no importance (their share raised from the floor to one equal share, the largest whose
   bytes fit), so the bytes held are the budget asked for, not the sum of full groups and floors.

This is HeadKV's allocation (a base budget for every head plus a shared pool in proportion to its score) with two
changes, both for the bytes to be the bytes held: a share is capped at the whole prompt (HeadKV's budgets may exceed
it; here the excess goes to the other groups through a larger pool, and to the groups of no importance once the
others are full), and the padding of a layer's groups to the largest is paid from the same budget. Scores above
``s0`` only count: DuoAttention's gates start at 0.5 and the groups training left near there get the floor, a small
window (more only where rule 4 applies).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["GroupBudgets", "allocate_group_budgets", "headkv_split", "stored_fraction"]


@dataclass(frozen=True)
class GroupBudgets:
    """``shares (L, G)`` float64: the share of each prompt a (layer, KV group) keeps, 1.0 = the full cache;
    ``stored``: the bytes it holds as a fraction of the dense cache, padding and positions counted."""

    shares: Tensor
    stored: float

    @property
    def full(self) -> Tensor:
        """``(L, G)`` bool: the groups kept in full."""
        return self.shares >= 1.0


def stored_fraction(shares: Tensor, entry_overhead: float = 0.0, empty_layer: float = 0.0) -> float:
    """The bytes ``shares (L, G)`` hold as a fraction of the dense cache: a full group 1, each layer's other groups
    padded to their largest share, ``1 + entry_overhead`` per entry; a layer with no full group also
    ``empty_layer`` (of one group's bytes: the compact cache's token-counting placeholder).

    >>> stored_fraction(torch.tensor([[1.0, 0.5, 0.25]]))
    0.6666666666666666
    """
    L, G = shares.shape
    full = shares >= 1.0
    partial = shares.masked_fill(full, 0.0)
    padded = partial.amax(-1) * (~full).sum(-1) * (1.0 + entry_overhead)  # (L,)
    placeholder = (~full.any(-1)).double() * empty_layer  # (L,)
    return float((full.sum(-1) + padded + placeholder).sum()) / (L * G)


def check_scores(scores: Any, shape: tuple[int, int] | None = None, what: str = "scores") -> Tensor:
    """``scores`` as a float64 ``(L, G)`` tensor, refused by name when it is not a finite matrix (of ``shape``)."""
    t = torch.as_tensor(scores, dtype=torch.float64) if not isinstance(scores, Tensor) else scores.double()
    if t.dim() != 2 or t.numel() == 0:
        raise ValueError(f"headkv: {what} must be a (layers, KV groups) matrix, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"headkv: {what} has shape {tuple(t.shape)}, this model needs {shape} (one score per layer "
                         "and KV group)")
    bad = ~t.isfinite()
    if bool(bad.any()):
        raise ValueError(f"headkv: {what} holds non-finite values (NaN or inf) at (layer, group) "
                         f"{bad.nonzero().tolist()[:8]}: compute the scores again")
    return t


def allocate_group_budgets(scores: Tensor, fraction: float, *, floor: float = 1 / 32, score_floor: float | None = None,
                           entry_overhead: float = 0.0, empty_layer: float = 0.0, full: float = 0.0) -> GroupBudgets:
    """Shares of the prompt per (layer, KV group) holding at most ``fraction`` of the dense cache's bytes, by the
    rule in this module's docstring. ``floor``: the share every group keeps (a small window); ``score_floor``: the
    score that counts as no importance (default: the smallest); ``entry_overhead``: a non-full group's bytes per
    kept token beyond its keys and values, relative to them (``headkv``: 8-byte positions,
    ``8 / (2 * head_dim * dtype bytes)``); ``empty_layer``: what a layer keeping no group in full adds, in one
    group's bytes (the compact cache's placeholder of one value per token for keys and values: ``1 / head_dim``).
    ``full``: the share of all (layer, KV group) pairs kept in full first, those with the highest scores
    (``round(full * L * G)`` of them, ties to the lower index); the rest of the budget is shared by the same rule
    over the others (importance above the smallest of their scores). 0 (the default): HeadKV's rule alone.

    >>> b = allocate_group_budgets(torch.tensor([[0.5, 0.9, 0.6], [0.5, 0.55, 0.5]]), 0.5, floor=0.125)
    >>> b.shares.round(decimals=3).tolist(), round(b.stored, 3)
    ([[0.125, 1.0, 0.518], [0.125, 0.321, 0.125]], 0.5)
    """
    s = check_scores(scores)
    if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0.0 < fraction <= 1.0):
        raise ValueError(f"headkv: the byte budget must be a fraction of the dense cache in (0, 1], got {fraction!r}")
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"headkv: floor (the share every group keeps) must be in (0, 1], got {floor!r}")
    if not (isinstance(full, (int, float)) and not isinstance(full, bool) and 0.0 <= full < 1.0):
        raise ValueError(f"headkv: full (the share of the groups kept in full first) must be in [0, 1), got {full!r}")
    n_full = round(full * s.numel())
    if n_full >= s.numel():
        raise ValueError(f"headkv: full={full:g} keeps all {s.numel()} groups in full: that is the dense cache")
    forced = torch.zeros(s.shape, dtype=torch.bool)
    forced.view(-1)[torch.sort(-s.flatten(), stable=True).indices[:n_full]] = True
    least = stored_fraction(torch.full_like(s, floor).masked_fill(forced, 1.0), entry_overhead, empty_layer)
    if least > fraction + 1e-12:
        what = f"keep {int(forced.sum())} groups in full (full={full:g}) and " if bool(forced.any()) else ""
        raise ValueError(f"headkv: a budget of {fraction:g} of the dense cache cannot {what}give every group its "
                         f"floor share {floor:g} ({least:.4f} of the bytes with positions): raise the budget or lower "
                         f"floor{' or full' if what else ''}")
    if fraction >= 1.0:  # the dense cache's bytes: every group whole, the zero-importance ones too
        return GroupBudgets(torch.ones_like(s), 1.0)
    rest = s[~forced]
    s0 = rest.min() if score_floor is None else torch.tensor(score_floor, dtype=torch.float64)
    w = (s - s0).clamp_min(0.0).masked_fill(forced, 0.0)
    w = (~forced).double() / rest.numel() if float(w.sum()) == 0.0 else w / w.sum()

    def shares_at(pool: float) -> Tensor:
        raw = floor + pool * w
        return torch.where((raw >= 1.0 - 1e-9) | forced, torch.ones_like(raw), raw)

    def fits(pool: float) -> bool:
        return stored_fraction(shares_at(pool), entry_overhead, empty_layer) <= fraction

    # The stored bytes grow with the pool except where a group reaches the full cache: its layer's padding may then
    # drop. Between those points they grow, so the largest pool that fits is the largest in the last interval whose
    # start fits, found by bisection inside it.
    reach = sorted({(1.0 - floor) / float(x) for x in w.flatten() if x > 0})  # pools at which a group turns full
    starts, ends = [0.0, *reach], [*reach, float("inf")]
    lo = 0.0
    for start, end in zip(reversed(starts), reversed(ends)):
        if not fits(start):
            continue
        lo, hi = start, end if end != float("inf") else start
        for _ in range(100 if hi > lo else 0):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        break
    shares = shares_at(lo)
    if bool((shares[w > 0] >= 1.0).all()):  # the pool cannot grow: the rest goes to the groups of no importance
        shares = _share_the_rest_equally(shares, fraction, entry_overhead, empty_layer)
    return GroupBudgets(shares, stored_fraction(shares, entry_overhead, empty_layer))


def _share_the_rest_equally(shares: Tensor, fraction: float, entry_overhead: float, empty_layer: float) -> Tensor:
    """``shares`` with its non-full groups raised to one equal share, the largest whose bytes fit ``fraction``."""
    rest = shares < 1.0
    lo, hi = float(shares[rest].max()) if bool(rest.any()) else 1.0, 1.0
    for _ in range(100 if hi > lo else 0):  # below 1 the bytes grow with the share; at 1 they are dense's, over budget
        mid = (lo + hi) / 2
        fit = stored_fraction(shares.masked_fill(rest, mid), entry_overhead, empty_layer) <= fraction
        lo, hi = (mid, hi) if fit else (lo, mid)
    return shares.masked_fill(rest, lo) if bool(rest.any()) else shares


def headkv_split(model: nn.Module, scores: Tensor | str | Path, fraction: float, *, floor: float = 1 / 32,
                 score_floor: float | None = None, sinks: int = 4, observe: int = 64, pool: int = 5,
                 select: str = "snapkv", full: float = 0.0, decode_kernel: bool = False) -> nn.Module:
    """Apply per-group budgets in place: ``scores`` (a ``(L, G)`` tensor, or a gates file of ``condcomp
    calibrate-kv``) allocated over every (layer, KV group) within ``fraction`` of the dense cache's bytes
    (:func:`allocate_group_budgets`, positions counted at the model's dtype and head width); per layer a ``topk``
    router warm-started from the scores keeps the full groups, and ``kv=("headkv", {"shares": ...})`` holds the
    others (``sinks``, ``observe``, ``pool``, ``select`` as :class:`~condcomp.kv.headkv.HeadKV`); ``full``: the
    share of the groups kept in full before the budget is shared (the highest-scored first); ``decode_kernel``: as
    :class:`~condcomp.CondCompConfig`'s (decode steps on a static cache attend the full groups with the split-K
    kernel; the ``headkv`` groups keep their own attention). Returns
    ``model`` in eval mode. The shares are of each request's prompt, so the bytes are the same fraction at any
    prompt length (but for whole-token rounding).

    >>> import condcomp.kv.headkv_budget as hb  # doctest: +SKIP
    >>> model = hb.headkv_split(smollm2, "results/kv/duo_gates.json", 0.25)  # doctest: +SKIP
    """
    from condcomp.api import apply_
    from condcomp.config import CondCompConfig
    from condcomp.kv.calibration import attention_layers, head_groups
    from condcomp.kv.duo_gates import load_gates
    from condcomp.kv.importance import warm_start_scores

    H, G = head_groups(model)
    layers = attention_layers(model)
    table = (load_gates(scores, len(layers), G)["scores"] if isinstance(scores, (str, Path))
             else check_scores(scores, (len(layers), G)))
    cfg: Any = getattr(model, "config")  # noqa: B009
    head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // H)
    itemsize = next(model.parameters()).element_size()
    budgets = allocate_group_budgets(table, fraction, floor=floor, score_floor=score_floor,
                                     entry_overhead=8 / (2 * head_dim * itemsize), empty_layer=1 / head_dim, full=full)
    kept_full = budgets.full
    for layer, init, kept, shares in zip(layers, warm_start_scores(table), kept_full, budgets.shares, strict=True):
        apply_(model, CondCompConfig(
            policy=("fixed", {"fraction": int(kept.sum()) / G, "k_min": 0}),
            router=("topk", {"kv_groups": True, "init_scores": init}),
            kv=("headkv", {"shares": [float(x) for x in shares], "sinks": sinks, "observe": observe, "pool": pool,
                           "select": select}),
            target_modules=[layer], decode_kernel=decode_kernel))
    return model.eval()
