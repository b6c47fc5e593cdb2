"""Per-request plans for causal LMs: a sequence plan decided once from the prompt and held while the request decodes.

A sequence plan is one head set per example. For a decoder that generates with a KV cache, "per example" means
per *request*: the plan is decided at prefill, from the prompt, and the same heads serve every later token of
that request. Two consequences make head budgets pay at decode time:

- **Nothing is routed per token.** Decode steps reuse the held plan: no policy, no router, no plan building.
- **The KV cache holds only what the plan keeps.** A key/value head (a KV group under GQA: the ``H / Hkv`` query
  heads that share it) that no kept query head reads is neither computed nor cached, so every decode step reads
  a fraction of the cache. :class:`KVSelection` says which groups each row keeps and where they sit in the cache.

The plan is stored *in* the request's KV cache, per layer and row (:class:`HeldPlan`; the transformers side is
``condcomp.integrations.hf.cache``), so the cache's own operations (reset, crop, beam reordering, selecting rows,
copies, pickling) act on it too. :func:`condcomp.request_plans` reads it (:class:`RequestPlan`).

Training matches it with :func:`condcomp.plan_from_prompt`: inside it, sequence plans are decided from the first
``prompt_len`` positions only, as at inference (put the loss on the continuation; the prompt's own tokens were
computed with a plan that saw the whole prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from condcomp.plans import kv_groups_used
from condcomp.types import HeadLayout, HeadPlan


@dataclass(frozen=True)
class KVSelection:
    """Which key/value heads a held sequence plan keeps, per row, in the compact order the cache stores them.

    - ``kv_index (B, g)`` int64: row b's cache slot j holds key/value head ``kv_index[b, j]``. ``g`` is the
      largest number of kept groups in the batch; a row that keeps fewer repeats its first kept group in the
      spare slots (finite values, gate 0), so rows with different kept sets share one tensor.
    - ``slot_gates (B, g * r)``: the gate of every query head that reads a slot (``r = H / Hkv`` per slot, in
      head order), 0 for heads the plan skips inside a kept group and for spare slots.
    - ``row_active (B,)``: rows with at least one active head (a row with none outputs exactly zero), or None
      when every row has one.
    - ``identity``: every row keeps every group in order (the full budget): no gathers, no scatters.
    - ``unit_gates``: every slot gate is exactly 1: no gate multiply.
    """

    kv_index: Tensor
    slot_gates: Tensor
    row_active: Tensor | None
    identity: bool
    unit_gates: bool

    @property
    def slots(self) -> int:
        """``g``: key/value heads cached per row."""
        return int(self.kv_index.shape[1])


def select_kv(plan: HeadPlan, layout: HeadLayout) -> KVSelection:
    """The :class:`KVSelection` of a sequence plan (a few host syncs, at prefill only: ``g`` sizes the cache)."""
    if plan.granularity != "sequence":
        raise ValueError("only sequence plans (one head set per request) can shrink a KV cache; a token plan may "
                         "pick any head at a later token, so every key/value head must stay cached")
    B, Hkv, r = plan.gates.shape[0], layout.num_kv_heads, layout.group_size
    gates = plan.gates.detach().masked_fill(~plan.active, 0.0)  # (B, H)
    kept = kv_groups_used(plan.active, Hkv)  # (B, Hkv)
    counts = kept.sum(-1)  # (B,)
    # At least one slot, even when no row keeps a group (k = 0): a cache layer of zero heads holds no elements,
    # and transformers' layers then count no tokens (the request's plan would be dropped and the model's
    # positions restart) or cannot quantize it; the slot holds group 0 with gate 0 and the rows output zeros.
    g = max(int(counts.max()), 1) if B else 0
    groups = torch.arange(Hkv, device=kept.device)
    # kept groups first, ascending; a row's spare slots repeat its first kept group (group 0 if it keeps none)
    order = torch.argsort((~kept).long() * Hkv + groups, dim=-1)[:, :g]  # (B, g)
    valid = torch.arange(g, device=kept.device) < counts.unsqueeze(-1)  # (B, g)
    kv_index = torch.where(valid, order, order[:, :1].expand(B, g) if g else order)
    slot_gates = gates.view(B, Hkv, r).gather(1, kv_index.unsqueeze(-1).expand(B, g, r))  # (B, g, r)
    slot_gates = (slot_gates * valid.unsqueeze(-1)).reshape(B, g * r)
    identity = g == Hkv and bool((kv_index == groups).all()) if B else True
    row_active = plan.active.any(-1)  # (B,)
    return KVSelection(kv_index, slot_gates, None if bool(row_active.all()) else row_active, identity,
                       bool((slot_gates == 1).all()))


def decision_mask(mask: Tensor | None, prompt_len: int | None, B: int, T: int, device: torch.device) -> Tensor | None:
    """The positions a sequence plan is decided from: real tokens among the first ``prompt_len`` (all if None)."""
    if prompt_len is None or prompt_len >= T:
        return mask
    prefix = (torch.arange(T, device=device) < prompt_len).expand(B, T)  # (B, T)
    return prefix if mask is None else mask.bool() & prefix


def _take_rows(selection: KVSelection, index: Tensor) -> KVSelection:
    # identity and unit gates hold for any subset of rows that had them (dropping rows cannot break them)
    row_active = None if selection.row_active is None else selection.row_active[index]
    return KVSelection(selection.kv_index[index], selection.slot_gates[index], row_active, selection.identity,
                       selection.unit_gates)


def pad_slots(selection: KVSelection, slots: int) -> KVSelection:
    """``selection`` widened to ``slots`` cache slots per row (a static cache allocated for more): the spare slots
    repeat the row's first slot with gate 0, as :func:`select_kv` fills them."""
    g = selection.slots
    if slots == g:
        return selection
    if slots < g:
        raise ValueError(f"cannot fit {g} kept key/value groups into {slots} cache slots")
    B, r = selection.kv_index.shape[0], selection.slot_gates.shape[1] // max(g, 1)
    first = selection.kv_index[:, :1] if g else selection.kv_index.new_zeros(B, 1)
    kv_index = torch.cat([selection.kv_index, first.expand(B, slots - g)], 1)  # (B, slots)
    gates = torch.cat([selection.slot_gates, selection.slot_gates.new_zeros(B, (slots - g) * r)], 1)
    return KVSelection(kv_index, gates, selection.row_active, False, False)


@dataclass(frozen=True)
class HeldPlan:
    """A request's plan as stored with one layer of its KV cache, one row per cache row.

    - ``plan``: the sequence :class:`~condcomp.HeadPlan` decided at the request's first call (detached), ``(B, H)``.
    - ``selection``: the cache's slot order when it holds only the plan's key/value groups
      (:class:`KVSelection`); None when it holds every key/value head in order.
    - ``num_kv_heads``: the layer's key/value heads, so a cache of another layout is recognised.

    Cache operations that act on rows (beam reordering, selecting or repeating rows) act on the held plan through
    :meth:`take_rows` and :meth:`repeat_rows`.
    """

    plan: HeadPlan
    selection: KVSelection | None
    num_kv_heads: int

    @property
    def rows(self) -> int:
        """Requests (cache rows) the plan covers."""
        return int(self.plan.gates.shape[0])

    def take_rows(self, index: Tensor) -> HeldPlan:
        """The plan of rows ``index`` (an int64 index or a bool mask over rows), in that order."""
        p = self.plan
        index = index.to(p.gates.device)
        plan = HeadPlan(p.granularity, p.gates[index], p.active[index], p.counts[index], p.order[index], {})
        sel = None if self.selection is None else _take_rows(self.selection, index.to(self.selection.kv_index.device))
        return HeldPlan(plan, sel, self.num_kv_heads)

    def repeat_rows(self, repeats: int) -> HeldPlan:
        """Every row repeated ``repeats`` times in place (``repeat_interleave``, as the cache's rows are)."""
        index = torch.arange(self.rows, device=self.plan.gates.device).repeat_interleave(repeats)
        return self.take_rows(index)

    def with_slots(self, slots: int) -> HeldPlan:
        """The same plan over ``slots`` cache slots per row (see :func:`pad_slots`)."""
        assert self.selection is not None
        return HeldPlan(self.plan, pad_slots(self.selection, slots), self.num_kv_heads)


@dataclass(frozen=True)
class RequestPlan:
    """What each request (row of a KV cache) keeps in one layer: read it with :func:`condcomp.request_plans`.

    - ``heads (B, H)`` bool: the query heads each row computes.
    - ``kv_groups (B, Hkv)`` bool: the key/value heads (GQA groups) each row's cache holds; every group when the
      cache holds every head (adapters without a compact cache, or a per-token plan).
    - ``gates (B, H)``: each head's gate (0 for skipped heads).
    - ``compact``: whether the cache stores only the kept groups (so its bytes scale with them).
    """

    heads: Tensor
    kv_groups: Tensor
    gates: Tensor
    compact: bool

    def kept_heads(self) -> list[list[int]]:
        """Per row, the indices of the heads it computes."""
        return [row.nonzero().flatten().tolist() for row in self.heads]

    def kept_kv_groups(self) -> list[list[int]]:
        """Per row, the indices of the key/value groups its cache holds."""
        return [row.nonzero().flatten().tolist() for row in self.kv_groups]

    @classmethod
    def of(cls, held: HeldPlan) -> RequestPlan:
        """The public view of a plan held with a cache layer."""
        p = held.plan
        B, H = p.active.shape
        if held.selection is None:
            groups = torch.ones(B, held.num_kv_heads, dtype=torch.bool, device=p.active.device)
        else:
            groups = kv_groups_used(p.active, held.num_kv_heads)  # (B, Hkv)
        return cls(p.active.clone(), groups, p.gates.masked_fill(~p.active, 0.0), held.selection is not None)
