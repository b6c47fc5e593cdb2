"""Sizing a call: the one device -> host read of the gathered executor (call.py wraps its result in the call object).

Everything a strategy needs to decide whether it can run, and how large its packed tensors are, comes from one
``tolist()`` of a few small tensors (:func:`gather_sizes`); nothing else in the executor synchronises. The capturable
path reads nothing: :func:`static_sizes` sizes a sequence plan from its declared ``k_cap`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from condcomp.executors.gathered.tuning import CPU, GatheredTuning
from condcomp.plans import kv_groups_used
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


@dataclass(frozen=True)
class GatherSizes:
    """Host-side sizes of one call's packed work (the single device -> host read of the gathered path).

    ``buckets``: sequence plans, ``(k, k_kv, n_examples)`` in the order the examples are sorted by.
    ``rows_per_head``: token plans, the most tokens of one example that selected each head ``(H,)``.
    ``shared_heads``: sequence plans in which every example chose the same heads, those heads (else None).
    ``work_fraction``: share of the dense block's (query row, head) work the gathered path will compute.
    ``every_row_active``: token plans in which every (example, token) row chose at least one head.
    ``head_sets``: token plans with at most ``tuning.max_set_heads`` heads and large enough for the per-set strategy,
    ``(heads as a bit mask, rows)`` of every distinct head set the (example, token) rows chose, ascending by mask
    (empty otherwise).
    ``read``: whether these sizes were read back from the device; False for :func:`static_sizes` (only the
    strategies that need no sizes, ``Strategy.needs_sizes = False``, can run such a call).
    """

    granularity: str
    buckets: tuple[tuple[int, int, int], ...] = ()
    rows_per_head: tuple[int, ...] = ()
    work_fraction: float = 1.0
    shared_heads: tuple[int, ...] | None = None
    every_row_active: bool = False
    head_sets: tuple[tuple[int, int], ...] = ()
    read: bool = True


def static_sizes(plan: HeadPlan) -> GatherSizes:
    """A plan's sizes without a device read. Sequence plans: ``k_cap`` heads for every example (H without a cap),
    so ``work_fraction`` is ``k_cap / H``, the padded work the capturable path computes. Token plans: 1.0 (the
    capturable token paths attend with every head's query slots: dense attention cost)."""
    if plan.granularity == "token":
        return GatherSizes("token", work_fraction=1.0, read=False)
    return GatherSizes("sequence", work_fraction=plan.head_cap / max(plan.num_heads, 1), read=False)


def head_set_keys(active: Tensor) -> Tensor:
    """``(..., H)`` bool -> ``(...)`` int64: the chosen heads as a bit mask (bit h = head h)."""
    bits = torch.ones((), dtype=torch.long, device=active.device) << torch.arange(
        active.shape[-1], device=active.device)
    return (active.long() * bits).sum(-1)


def gather_sizes(weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
                 tuning: GatheredTuning | None = None) -> GatherSizes:
    """Read back the sizes that shape the packed tensors (one host synchronisation); ``tuning`` (default: CPU)
    says whether token plans also count their head sets."""
    tuning = tuning or CPU
    L = weights.layout
    H, Hkv = L.num_heads, L.num_kv_heads
    if plan.granularity == "sequence":
        counts = plan.counts.long()  # (B,)
        kvc = kv_groups_used(plan.active, Hkv).sum(-1) if L.group_size > 1 else counts  # (B,)
        B = plan.gates.shape[0]
        hist = torch.bincount(counts * (Hkv + 1) + kvc, minlength=(H + 1) * (Hkv + 1))
        same = (plan.active == plan.active[:1]).all().view(1) if B else hist.new_zeros(1)
        first = plan.active[0] if B else plan.active.new_zeros(H)
        read = torch.cat([hist, same.long(), first.long()]).tolist()  # the one device -> host read
        n_hist = (H + 1) * (Hkv + 1)
        buckets = tuple((key // (Hkv + 1), key % (Hkv + 1), n) for key, n in enumerate(read[:n_hist]) if n)
        shared = tuple(h for h in range(H) if read[n_hist + 1 + h]) if read[n_hist] else None
        work = sum(k * n for k, _, n in buckets) / max(B * H, 1)
        return GatherSizes("sequence", buckets=buckets, work_fraction=work, shared_heads=shared)
    T = plan.gates.shape[1]
    if not plan.gates.shape[0]:
        return GatherSizes("token", rows_per_head=(0,) * H, work_fraction=0.0)
    every = (plan.counts > 0).all().view(1).long()
    parts = [plan.active.sum(1).amax(0), every]  # (H,) + 1
    # + (2**H,): how many rows chose each head set; skipped where even one set of every row would be too small
    # for the per-set strategy (B*T*D bounds rows per set x D)
    if H <= tuning.max_set_heads and inputs.x.numel() >= tuning.min_set_work:
        parts.append(torch.bincount(head_set_keys(plan.active).reshape(-1), minlength=2 ** H))
    read = torch.cat(parts).tolist()  # the one device -> host read
    rows, every_row = read[:H], read[H]
    sets = tuple((key, n) for key, n in enumerate(read[H + 1:]) if n)
    return GatherSizes("token", rows_per_head=tuple(rows), work_fraction=sum(rows) / max(H * T, 1),
                       every_row_active=bool(every_row), head_sets=sets)


def routed_head_sets(head_sets: tuple[tuple[int, int], ...], routed: list[int],
                     limit: int | None = None) -> list[tuple[int, int]] | None:
    """``(mask, rows)`` of every routed-head set the rows chose, ascending by mask; bit ``j`` of a mask stands
    for ``routed[j]``. ``head_sets`` are the sizes' sets over all heads (the dense heads are dropped). None as
    soon as more than ``limit`` non-empty sets turn up."""
    rows: dict[int, int] = {}
    for key, n in head_sets:
        m = sum(1 << j for j, h in enumerate(routed) if key >> h & 1)
        rows[m] = rows.get(m, 0) + n
        if limit is not None and len(rows) - (0 in rows) > limit:
            return None
    return sorted(rows.items())
