"""KV selection: which key/value groups a request keeps, and how, under a sequence plan held while it decodes.

A sequence plan is one head set per example. For a decoder that generates with a KV cache, "per example" means
per *request*: the plan is decided at prefill, from the prompt, and the same heads serve every later token of
that request. Two consequences make head budgets pay at decode time:

- **Nothing is routed per token.** Decode steps reuse the held plan: no policy, no router, no plan building.
- **The KV cache holds only what the plan keeps.** A key/value head (a KV group under GQA: the ``H / Hkv`` query
  heads that share it) that no kept query head reads is neither computed nor cached, so every decode step reads
  a fraction of the cache. :class:`KVSelection` says which groups each row keeps and where they sit in the cache.
- **The groups it does not keep get the layer's KV policy** (:mod:`condcomp.kv.policy`): dropped (the default),
  kept in full, streamed through a window, or anything a registered policy stores.

The plan is stored *in* the request's KV cache, per layer and row (:class:`HeldPlan`; the transformers side is
``condcomp.integrations.hf.cache``), so the cache's own operations (reset, crop, beam reordering, selecting rows,
copies, pickling) act on it too. :func:`condcomp.request_plans` reads it (:class:`RequestPlan`).

Training matches it with :func:`condcomp.plan_from_prompt`: inside it, sequence plans are decided from the first
``prompt_len`` positions only, as at inference (put the loss on the continuation; the prompt's own tokens were
computed with a plan that saw the whole prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from condcomp.kv.policy import KV_FULL, KV_MODE_NAMES, KV_NONE, KV_WINDOW, DropKV, KVPolicy
from condcomp.kv.window import StreamWindow
from condcomp.kv.window_policy import WindowKV
from condcomp.plans import kv_groups_used
from condcomp.types import HeadLayout, HeadPlan

__all__ = ["KV_FULL", "KV_MODE_NAMES", "KV_NONE", "KV_WINDOW", "HeldPlan", "KVSelection", "RequestPlan",
           "StreamWindow", "as_kv_policy", "decision_mask", "pad_slots", "select_kv"]


@dataclass(frozen=True)
class KVSelection:
    """Which key/value heads a held sequence plan keeps, per row, in the compact order the cache stores them.

    - ``kv_index (B, g)`` int64: row b's cache slot j holds key/value head ``kv_index[b, j]`` in full. ``g`` is
      the largest number of fully kept groups in the batch; a row that keeps fewer repeats its first kept group in
      the spare slots (finite values, gate 0), so rows with different kept sets share one tensor.
    - ``slot_gates (B, g * r)``: the gate of every query head that reads a slot (``r = H / Hkv`` per slot, in
      head order), 0 for heads the plan skips inside a kept group and for spare slots.
    - ``row_active (B,)``: rows with at least one active head (a row with none outputs exactly zero), or None
      when every row has one.
    - ``identity``: every row keeps every group in order (the full budget): no gathers, no scatters.
    - ``unit_gates``: every slot gate is exactly 1: no gate multiply.
    - ``window_index (B, gw)`` / ``window_gates (B, gw * r)``: the groups each row keeps in the state of the KV
      policy ``policy`` (a streaming window for ``window``: ``window`` says how much), slots of a second tensor,
      spare slots as above; None when no row has such a group.
    - ``modes (B, Hkv)`` int8: each request's mode per group (``KV_NONE``, ``KV_WINDOW`` (the policy's own state),
      ``KV_FULL``).
    - ``policy``: the KV policy that holds the ``window_*`` slots (None when there are none).
    - ``holds_unkept``: the layer's KV policy holds the groups the plan does not keep (in its own state or in full:
      their heads are computed), decided with the selection so a decode step reads it as data.
    - ``slots`` / ``window_slots``: ``g`` and ``gw``; ``policy_name``: ``policy``'s name; ``window_keys``: the most
      keys a streamed head reads under ``window`` (its sinks + recent tokens); ``window_valid (B, gw)`` bool: the
      ``window_index`` slots that hold a group of the row the policy holds (the spare ones after them repeat the
      row's first such group at gate 0), None when no row has such a group. Resolved when the selection is built
      (not constructor arguments; a decode step reads them as data, asking the policy nothing).
    """

    kv_index: Tensor
    slot_gates: Tensor
    row_active: Tensor | None
    identity: bool
    unit_gates: bool
    window_index: Tensor | None = None
    window_gates: Tensor | None = None
    window: StreamWindow | None = None
    modes: Tensor | None = None
    policy: KVPolicy | None = None
    holds_unkept: bool = False
    # resolved when the selection is built (a decode step reads them as data, calling nothing here)
    slots: int = field(init=False)  # g: key/value heads cached in full per row
    window_slots: int = field(init=False)  # gw: key/value heads cached as a streaming window per row
    policy_name: str | None = field(init=False)  # the name of the policy holding the window_* slots
    window_keys: int | None = field(init=False)  # the most keys a streamed head reads under `window`
    window_valid: Tensor | None = field(init=False)  # (B, gw) bool: window slots holding a group of their row

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", int(self.kv_index.shape[1]))
        object.__setattr__(self, "window_slots", 0 if self.window_index is None else int(self.window_index.shape[1]))
        object.__setattr__(self, "policy_name", None if self.policy is None else self.policy.name)
        object.__setattr__(self, "window_keys", None if self.window is None else self.window.capacity)
        object.__setattr__(self, "window_valid", _held_slots(self.window_index, self.window_gates))

    def __setstate__(self, state: dict[str, Any]) -> None:  # one pickled before these were data gets them
        # (one pickled before holds_unkept: a policy holding its own slots holds the unkept groups, and so does one
        # that leaves no group uncached, `full`)
        modes = state.get("modes")
        state.setdefault("holds_unkept", state.get("policy") is not None
                         or (modes is not None and bool((modes != KV_NONE).all())))
        self.__dict__.update(state)
        self.__post_init__()


def _held_slots(index: Tensor | None, gates: Tensor | None) -> Tensor | None:
    """``(B, g)`` bool: the slots ``index (B, g)`` that hold a group of their row, from their heads' ``gates (B,
    g*r)`` (a held group's heads are at gate 1, a spare slot's at 0); None without slots."""
    if index is None or gates is None:
        return None
    B, g = index.shape
    return gates.view(B, g, -1).amax(-1) > 0


def _slots_of(chosen: Tensor, gates: Tensor, r: int, at_least_one: bool) -> tuple[Tensor, Tensor]:
    """``(index (B, g), slot gates (B, g*r))`` of the groups ``chosen (B, Hkv)``, ascending; spare slots repeat
    the row's first chosen group (group 0 if none) with gate 0."""
    B, Hkv = chosen.shape
    counts = chosen.sum(-1)  # (B,)
    g = int(counts.max()) if B else 0
    g = max(g, 1) if at_least_one and B else g
    groups = torch.arange(Hkv, device=chosen.device)
    order = torch.argsort((~chosen).long() * Hkv + groups, dim=-1)[:, :g]  # (B, g): chosen first, ascending
    valid = torch.arange(g, device=chosen.device) < counts.unsqueeze(-1)  # (B, g)
    index = torch.where(valid, order, order[:, :1].expand(B, g) if g else order)
    slot_gates = gates.view(B, Hkv, r).gather(1, index.unsqueeze(-1).expand(B, g, r))  # (B, g, r)
    return index, (slot_gates * valid.unsqueeze(-1)).reshape(B, g * r)


def as_kv_policy(policy: KVPolicy | StreamWindow | None) -> KVPolicy:
    """A KV policy from a policy, a :class:`StreamWindow` (the window policy) or None (``drop``)."""
    if policy is None:
        return DropKV()
    if isinstance(policy, StreamWindow):
        return WindowKV(policy.sinks, policy.window, policy.model_window)
    if not isinstance(policy, KVPolicy):
        raise TypeError(f"expected a KV policy (condcomp.kv.KVPolicy) or a StreamWindow, got {policy!r}")
    return policy


def select_kv(plan: HeadPlan, layout: HeadLayout, window: KVPolicy | StreamWindow | None = None,
              detach: bool = True) -> KVSelection:
    """The :class:`KVSelection` of a sequence plan (a few host syncs, at prefill only: ``g`` sizes the cache).

    ``window``: the KV policy of the groups the plan does not keep (None: dropped; a :class:`StreamWindow`: the
    ``window`` policy, sinks + recent tokens with every query head of the group at gate 1; ``full``: cached in full,
    heads at gate 1). ``detach=False`` keeps the gates' graph (cache-free calls).
    """
    if plan.granularity != "sequence":
        raise ValueError("only sequence plans (one head set per request) can shrink a KV cache; a token plan may "
                         "pick any head at a later token, so every key/value head must stay cached")
    policy = as_kv_policy(window)
    B, Hkv, r = plan.gates.shape[0], layout.num_kv_heads, layout.group_size
    gates = plan.gates.masked_fill(~plan.active, 0.0)  # (B, H)
    gates = gates.detach() if detach else gates
    kept = kv_groups_used(plan.active, Hkv)  # (B, Hkv): groups some active head reads
    if policy.stores == "full":  # the unkept groups join the full cache, their heads at gate 1
        unkept_heads = (~kept).repeat_interleave(r, dim=1)  # (B, H)
        gates = torch.where(unkept_heads, torch.ones_like(gates), gates)
        kept = torch.ones_like(kept)
    streamed = ~kept if policy.stores == "own" else torch.zeros_like(kept)
    modes = torch.where(kept, KV_FULL, torch.where(streamed, KV_WINDOW, KV_NONE)).to(torch.int8)  # (B, Hkv)
    streams = B > 0 and bool(streamed.any())
    # At least one full slot unless groups stream, even when no row keeps a group (k = 0): a cache layer of zero
    # heads holds no elements, and transformers' layers then count no tokens (the request's plan would be dropped
    # and the model's positions restart); the slot holds group 0 with gate 0 and the rows output zeros.
    kv_index, slot_gates = _slots_of(kept, gates, r, at_least_one=not streams)
    g = kv_index.shape[1]
    identity = g == Hkv and bool((kv_index == torch.arange(Hkv, device=kept.device)).all()) if B else True
    row_active = plan.active.any(-1) | streamed.any(-1)  # (B,)
    if policy.stores == "full":  # every group is read, at gate 1 where the plan skipped it
        row_active = torch.ones_like(row_active)
    window_index = window_gates = None
    if streams:
        window_index, window_gates = _slots_of(streamed, torch.ones_like(gates), r, at_least_one=False)
    spec = policy.window_spec if streams and isinstance(policy, WindowKV) else None
    return KVSelection(kv_index, slot_gates, None if bool(row_active.all()) else row_active, identity,
                       bool((slot_gates == 1).all()), window_index, window_gates, spec, modes,
                       policy if streams else None, policy.needs_cache)


def decision_mask(mask: Tensor | None, prompt_len: int | None, B: int, T: int, device: torch.device) -> Tensor | None:
    """The positions a sequence plan is decided from: real tokens among the first ``prompt_len`` (all if None)."""
    if prompt_len is None or prompt_len >= T:
        return mask
    prefix = (torch.arange(T, device=device) < prompt_len).expand(B, T)  # (B, T)
    return prefix if mask is None else mask.bool() & prefix


def _take_rows(selection: KVSelection, index: Tensor) -> KVSelection:
    # identity and unit gates hold for any subset of rows that had them (dropping rows cannot break them)
    def rows(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[index]

    return KVSelection(selection.kv_index[index], selection.slot_gates[index], rows(selection.row_active),
                       selection.identity, selection.unit_gates, rows(selection.window_index),
                       rows(selection.window_gates), selection.window, rows(selection.modes), selection.policy,
                       selection.holds_unkept)


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
    return replace(selection, kv_index=kv_index, slot_gates=gates, identity=False, unit_gates=False)


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
        plan = HeadPlan(p.granularity, p.gates[index], p.active[index], p.counts[index], p.order[index], {},
                        p.k_cap)
        sel = None if self.selection is None else _take_rows(self.selection, index.to(self.selection.kv_index.device))
        return HeldPlan(plan, sel, self.num_kv_heads)

    def repeat_rows(self, repeats: int) -> HeldPlan:
        """Every row repeated ``repeats`` times in place (``repeat_interleave``, as the cache's rows are)."""
        index = torch.arange(self.rows, device=self.plan.gates.device).repeat_interleave(repeats)
        return self.take_rows(index)

    def check(self, layer_idx: int, layout: HeadLayout, rows: int, stored_heads: int | None) -> None:
        """Refuse to continue from this plan when the cache was filled by another model (``layout``: the layer's),
        holds another batch (``rows``: the call's), or had its tensors replaced (``stored_heads``: the key/value
        heads per row the layer's key tensor holds, None when it holds none)."""
        if self.num_kv_heads != layout.num_kv_heads or self.plan.num_heads != layout.num_heads:
            raise ValueError(f"layer {layer_idx}: the KV cache holds a plan for {self.plan.num_heads} heads / "
                             f"{self.num_kv_heads} key/value heads, this layer has {layout.num_heads} / "
                             f"{layout.num_kv_heads}: it was filled by another model; start the request with a fresh "
                             "cache")
        if self.rows != rows:
            raise ValueError(f"layer {layer_idx}: the KV cache holds plans for {self.rows} request(s) but the call "
                             f"has {rows} rows; select or repeat the cache's rows with its own methods "
                             "(batch_select_indices, batch_repeat_interleave, reorder_cache), which carry the plans")
        sel = self.selection
        if sel is not None and stored_heads is not None and (
                stored_heads != max(sel.slots, 1 if sel.window_index is not None else 0)):
            raise ValueError(f"layer {layer_idx}: the KV cache holds {stored_heads} key/value heads per row but its "
                             f"plan keeps {sel.slots}: its tensors were replaced by another model's")

    def with_slots(self, slots: int) -> HeldPlan:
        """The same plan over ``slots`` cache slots per row (see :func:`pad_slots`)."""
        assert self.selection is not None
        return HeldPlan(self.plan, pad_slots(self.selection, slots), self.num_kv_heads)


@dataclass(frozen=True)
class RequestPlan:
    """What each request (row of a KV cache) keeps in one layer: read it with :func:`condcomp.request_plans`.

    - ``heads (B, H)`` bool: the query heads each row computes (a streamed group's heads included).
    - ``kv_groups (B, Hkv)`` bool: the key/value heads (GQA groups) each row's cache holds in full; every group
      when the cache holds every head (adapters without a compact cache, or a per-token plan).
    - ``gates (B, H)``: each head's gate (0 for skipped heads, 1 for a streamed group's heads).
    - ``compact``: whether the cache stores only the kept groups (so its bytes scale with them).
    - ``kv_modes (B, Hkv)`` int8: each group's mode, ``KV_FULL`` (2), ``KV_WINDOW`` (1: the KV policy's own
      state) or ``KV_NONE`` (0); read as names with :meth:`group_modes`. ``window``: what a streamed group keeps
      (None when none streams). ``kv_policy``: the name of the policy mode 1 stands for (``"window"`` when None).
    """

    heads: Tensor
    kv_groups: Tensor
    gates: Tensor
    compact: bool
    kv_modes: Tensor | None = None
    window: StreamWindow | None = None
    kv_policy: str | None = None

    def kept_heads(self) -> list[list[int]]:
        """Per row, the indices of the heads it computes."""
        return [row.nonzero().flatten().tolist() for row in self.heads]

    def kept_kv_groups(self) -> list[list[int]]:
        """Per row, the indices of the key/value groups its cache holds in full."""
        return [row.nonzero().flatten().tolist() for row in self.kv_groups]

    def group_modes(self) -> list[list[str]]:
        """Per row, each key/value group's mode: ``"full"``, ``"window"`` (or the name of the KV policy that holds
        it) or ``"none"``."""
        modes = self.kv_modes if self.kv_modes is not None else self.kv_groups.to(torch.int8) * KV_FULL
        names = (KV_MODE_NAMES[KV_NONE], self.kv_policy or KV_MODE_NAMES[KV_WINDOW], KV_MODE_NAMES[KV_FULL])
        return [[names[int(m)] for m in row] for row in modes]

    @classmethod
    def of(cls, held: HeldPlan) -> RequestPlan:
        """The public view of a plan held with a cache layer."""
        p, sel = held.plan, held.selection
        B, H = p.active.shape
        r = H // held.num_kv_heads
        gates = p.gates.masked_fill(~p.active, 0.0)
        if sel is None:
            groups = torch.ones(B, held.num_kv_heads, dtype=torch.bool, device=p.active.device)
            return cls(p.active.clone(), groups, gates, False, groups.to(torch.int8) * KV_FULL)
        used = kv_groups_used(p.active, held.num_kv_heads)  # (B, Hkv): groups the plan keeps
        modes = sel.modes if sel.modes is not None else used.to(torch.int8) * KV_FULL
        # groups the plan does not keep that its KV policy still holds: every head computed, gate 1
        by_policy = ((modes != KV_NONE) & ~used).repeat_interleave(r, dim=1)  # (B, H)
        name = sel.policy.name if sel.policy is not None else None
        return cls(p.active | by_policy, modes == KV_FULL, torch.where(by_policy, torch.ones_like(gates), gates),
                   True, modes.clone(), sel.window, name)
