"""Cached decoding as an executor: a request's held plan over a compact KV cache (full groups, windows, none).

A decoder request's sequence plan is decided at its prefill and held in its KV cache. This executor computes a call
under such a plan the way a compact cache stores it: only the key/value groups the plan keeps are projected, cached
and read (``(B, g, S, Dh)``, :class:`~condcomp.kv.selection.KVSelection`); groups the layer's KV policy holds
(a streaming window, :mod:`condcomp.kv`) are attended by that policy over its state; the rest are never computed.
A model adapter translates its arguments into :class:`CompactKV` (how to write the cache, what it holds: a wrapped
transformers model passes its compact cache layer's methods, :class:`condcomp.kv.layer.CompactLayer`) and calls the
executor with it.

Called without a cache (``executor="kv_cache"`` on any sequence-plan call) it computes the same kept-groups
attention from the call's own keys and values: that is how it is compared with the reference executor, on the same
plans, as every executor is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from condcomp.dense import grouped_sdpa, project_kv
from condcomp.executors.base import keep_gates_in_graph
from condcomp.host import LastForward
from condcomp.kv.kernels.compact import compact_decode, per_request
from condcomp.kv.policy import KV_FULL, KV_WINDOW
from condcomp.kv.position_bias import RelativeBias
from condcomp.kv.selection import KVSelection, select_kv
from condcomp.masks import AttentionMask, build_attention_mask, dead_rows
from condcomp.plans import kv_groups_used
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout, HeadPlan, Projections


@dataclass(frozen=True)
class CompactKV:
    """A request's compact KV cache as one call sees it.

    - ``selection``: the held plan's slots (full groups, streamed groups).
    - ``store(k, v)``: appends the full slots' new keys/values ``(B, g, T, Dh)`` and returns their whole history
      ``(B, g, S, Dh)`` (a wrapped model passes its cache layer's :meth:`~condcomp.kv.layer.CompactLayer.store`).
    - ``visible``: keys the queries may see (a static cache's empty slots after them are dropped); None = all.
    - ``windows``: the state of the KV policy's groups before the call (None at prefill: a streaming window for
      ``window``); ``keep_windows`` stores the new one (the layer's ``keep_policy_state``).
    - ``state_layer``: instead of ``windows`` / ``keep_windows``, the cache layer that holds the KV policy's state
      (a held executor's decode calls): the policy reads, attends over and keeps it there in one call
      (:meth:`~condcomp.kv.policy.KVPolicy.attend_in`), and counts the keys its heads read from ``num_keys``, the
      call's ``S``; None: ``windows`` / ``keep_windows``.
    - ``projections``: how to project (None: the canonical weights).
    - ``placeholder_width``: when no group is kept in full, the full-length tensor holds a placeholder of this width
      that only counts the tokens (a quantized cache layer that quantizes in groups of ``n`` values needs ``n``).
    - ``position_bias``: a relative position bias the model adds to its scores (T5), which the KV policy's groups
      add at their kept keys' true positions (the full slots get it in ``attn_bias``); None without one.
    - ``kernel_held``: set when the split-K decode kernel is asked for (``CondCompConfig.decode_kernel`` on a
      static cache layer): the tokens the full slots hold after this call's write, a device scalar. A decode step
      (one query token, a mask the same for every head) then attends with one launch over slots ``[0,
      kernel_held)`` (:mod:`condcomp.kv.kernels`) instead of SDPA over the whole storage; None: SDPA.
    """

    selection: KVSelection
    store: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
    visible: int | None = None
    windows: Any = None
    keep_windows: Callable[[Any], None] | None = None
    projections: Projections | None = None
    placeholder_width: int = 1
    position_bias: RelativeBias | None = None  # the model's relative position bias of every query head (T5)
    kernel_held: Tensor | None = None
    state_layer: Any = None  # the cache layer holding the KV policy's state (its windows and keep_windows unset)
    num_keys: int | None = None  # the call's S, given with state_layer (what the policy's keys_read counts from)

    def policy_state(self) -> Any:
        """The KV policy's state before the call, wherever it is held (what its ``keys_read`` counts from)."""
        policy = self.selection.policy
        return self.windows if self.state_layer is None or policy is None else policy.state_in(self.state_layer)


def _heads_of_slots(index: Tensor, r: int) -> Tensor:
    """``(B, g*r)``: the query heads that read slots ``index (B, g)``."""
    return (index.unsqueeze(-1) * r + torch.arange(r, device=index.device)).flatten(1)


def _slot_mask(am: AttentionMask, heads: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The mask and dead rows of the query heads ``heads (B, n)`` (per-head masks gathered, shared ones kept)."""
    B, n = heads.shape
    m, dead = am.mask, am.dead
    if m is not None and m.shape[1] > 1:
        m = m.expand(B, *m.shape[1:]).gather(1, heads[:, :, None, None].expand(B, n, *m.shape[2:]))
    if dead is not None and dead.shape[1] > 1:
        dead = dead.expand(B, *dead.shape[1:]).gather(1, heads[:, :, None].expand(B, n, dead.shape[2]))
    return m, dead


def _slots(t: Tensor, index: Tensor, identity: bool) -> Tensor:
    """``t (B, T, Hkv, ...)`` at the groups ``index (B, g)`` -> ``(B, T, g, ...)``."""
    if identity:
        return t
    B, T = t.shape[:2]
    idx = index[:, None, :].reshape(B, 1, -1, *([1] * (t.dim() - 3)))
    return t.gather(2, idx.expand(B, T, index.shape[1], *t.shape[3:]))


def _queries(q: Tensor, proj: Projections, rotary: tuple[Tensor, Tensor] | None) -> Tensor:
    """``(B, T, g, r, Dh)`` -> normed, rotated ``(B, g*r, T, Dh)``."""
    B, T, g, r, Dh = q.shape
    q = q.reshape(B, T, g * r, Dh)
    if proj.q_norm is not None:
        q = proj.q_norm(q)
    q = q.transpose(1, 2)
    return apply_rotary(q, *rotary) if rotary is not None else q


def _keys(k: Tensor, proj: Projections, rotary: tuple[Tensor, Tensor] | None) -> Tensor:
    """``(B, T, g, Dh)`` -> normed, rotated ``(B, g, T, Dh)``."""
    if proj.k_norm is not None:
        k = proj.k_norm(k)
    k = k.transpose(1, 2)
    return apply_rotary(k, *rotary) if rotary is not None else k


def _gated(out: Tensor, gates: Tensor, dead: Tensor | None) -> Tensor:
    """Slot outputs ``(B, n, T, Dh)`` times their gates ``(B, n)`` or ``(B, n, T)``, dead (query, head) rows
    exactly zero."""
    if dead is not None:
        out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    g = gates[:, :, None, None] if gates.dim() == 2 else gates.unsqueeze(-1)
    return out * g.to(out.dtype)


def _combine(parts: list[tuple[Tensor, Tensor]], layout: HeadLayout, identity: bool) -> Tensor:
    """Slot outputs ``(B, n, T, Dh)`` at their groups ``(B, n/r)`` -> every head's columns ``(B, T, H*Dh)``."""
    r, Dh = layout.group_size, layout.head_dim
    B, _, T, _ = parts[0][0].shape
    flat = [(o.transpose(1, 2).reshape(B, T, idx.shape[1], r * Dh), idx) for o, idx in parts]
    if identity and len(flat) == 1:
        return flat[0][0].reshape(B, T, layout.num_heads * Dh)
    full = flat[0][0].new_zeros(B, T, layout.num_kv_heads, r * Dh)
    for out, idx in flat:  # spare slots add exact zeros
        full = full.scatter_add(2, idx[:, None, :, None].expand(B, T, idx.shape[1], r * Dh), out)
    return full.reshape(B, T, layout.num_heads * Dh)


def compact_attention(layout: HeadLayout, inputs: AttentionInputs, cache: CompactKV) -> Tensor:
    """One call under a held plan on a compact cache: ``inputs.x (B, T, D)`` -> ``(B, T, D)``. ``inputs``: the
    query input, padding (``mask``, ``key_mask``, ``attn_bias`` over the full slots' keys) and ``rotary``."""
    return _compact_call(layout, inputs, cache)[0]


def _compact_call(layout: HeadLayout, inputs: AttentionInputs, cache: CompactKV) -> tuple[Tensor, Any, int | None]:
    """:func:`compact_attention`'s output, the KV policy's state before the call as given (``cache.windows``) and
    the keys its heads read, counted by the policy in the call that holds its state in the cache layer
    (``cache.state_layer``; None otherwise: :meth:`CachedRun.usage` asks the policy from the state)."""
    x, sel, proj = inputs.x, cache.selection, cache.projections
    before, read = cache.windows, None
    assert proj is not None
    B, T, _ = x.shape
    Hkv, r, Dh, g = layout.num_kv_heads, layout.group_size, layout.head_dim, sel.slots
    q_flat, k_flat, v_flat = proj.project(x)
    q_all = q_flat.view(B, T, Hkv, r, Dh)
    k_all, v_all = k_flat.view(B, T, Hkv, Dh), v_flat.view(B, T, Hkv, Dh)
    parts: list[tuple[Tensor, Tensor]] = []
    dead: Tensor | None = None
    if g > 0:
        kernel = (cache.kernel_held is not None and T == 1 and inputs.dropout_p == 0.0
                  and per_request(inputs.attn_bias))
        # the kernel reads each slot's query heads through kv_index: every head's query, no gather
        q = _queries(q_all if kernel else _slots(q_all, sel.kv_index, sel.identity), proj, inputs.rotary)
        k = _keys(_slots(k_all, sel.kv_index, sel.identity), proj, inputs.rotary)  # (B, g, T, Dh)
        k, v = cache.store(k, _slots(v_all, sel.kv_index, sel.identity).transpose(1, 2))  # (B, g, S, Dh)
        if cache.visible is not None and k.shape[2] > cache.visible:
            k, v = k[:, :, :cache.visible], v[:, :, :cache.visible]
        am = build_attention_mask(AttentionInputs(x=x, mask=inputs.mask, key_mask=inputs.key_mask,
                                                  attn_bias=inputs.attn_bias, key_states=k, value_states=v),
                                  layout.causal, q.dtype)
        # the slots' query heads are gathered only for a per-head mask (none at a decode step: no index built)
        per_head = any(t is not None and t.shape[1] > 1 for t in (am.mask, am.dead))
        mask, slot_dead = _slot_mask(am, _heads_of_slots(sel.kv_index, r)) if per_head else (am.mask, am.dead)
        if kernel:
            assert cache.kernel_held is not None
            out = compact_decode(q, k, v, am, sel, cache.kernel_held, r, layout.scale)  # (B, g*r, 1, Dh)
        else:
            out = grouped_sdpa(q, k, v, mask, am.is_causal, layout.scale, inputs.dropout_p)  # (B, g*r, T, Dh)
        gated = out if sel.unit_gates and slot_dead is None else _gated(out, sel.slot_gates, slot_dead)
        parts.append((gated, sel.kv_index))
        dead = dead_rows(am, B, T)
    else:  # only streamed groups: the full-length tensor holds one narrow placeholder (it counts the tokens)
        placeholder = x.new_zeros(B, 1, T, cache.placeholder_width)
        cache.store(placeholder, placeholder)
    if sel.window_index is not None and sel.window_gates is not None and sel.policy is not None:
        q = _queries(_slots(q_all, sel.window_index, False), proj, inputs.rotary)  # (B, gw*r, T, Dh)
        k = _keys(_slots(k_all, sel.window_index, False), proj, inputs.rotary)  # (B, gw, T, Dh)
        v = _slots(v_all, sel.window_index, False).transpose(1, 2)
        joint: dict[str, Any] = {"slot_valid": sel.window_valid} if sel.policy.reads_slot_validity else {}
        if sel.policy.reads_slot_groups:  # per-group options (headkv's shares): which group each slot holds
            joint["slot_groups"] = sel.window_index
        if cache.position_bias is not None:  # opt-in arguments, as slot_valid
            if not sel.policy.reads_position_bias:
                raise ValueError(f"the KV policy {sel.policy.name!r} cannot add this model's relative position bias "
                                 "to its groups' scores (reads_position_bias): use kv='window', 'snapkv', 'adakv', "
                                 "'full' or 'drop' here")
            joint["position_bias"] = cache.position_bias.for_heads(_heads_of_slots(sel.window_index, r))
        if cache.state_layer is not None:  # the policy reads, attends over and keeps its state in the layer
            if cache.num_keys is None:
                raise ValueError("CompactKV.state_layer is set without num_keys: give the call's number of keys "
                                 "(the KV policy counts the keys its heads read from it)")
            out, w_dead, read = sel.policy.attend_in(cache.state_layer, q, k, v, inputs.mask, layout.scale,
                                                     cache.num_keys, **joint)
        else:  # the caller holds the state: given before the call, kept through keep_windows
            keep = cache.keep_windows
            out, w_dead, state = sel.policy.attend(q, k, v, before, inputs.mask, layout.scale, keep is not None,
                                                   **joint)
            if keep is not None:
                keep(state)
        parts.append((_gated(out, sel.window_gates, w_dead), sel.window_index))
        dead = w_dead.squeeze(1) if dead is None else dead
    if not parts:  # an empty batch
        return x.new_zeros(B, T, layout.d_model), before, read
    y = proj.o(_combine(parts, layout, sel.identity and len(parts) == 1))
    if sel.row_active is not None:  # a row with no active head outputs exactly zero (no output bias)
        y = torch.where(sel.row_active[:, None, None], y, torch.zeros_like(y))
    return (y if dead is None else y.masked_fill(dead.unsqueeze(-1), 0.0)), before, read


@dataclass(frozen=True)
class CachedRun:
    """The ``kv_cache`` executor bound to one cached call (what ``resolve_executor`` returns for it): calling it
    runs the call; ``strategy`` says how the cache is read; :meth:`usage` is the call's record for ``head_usage``;
    :meth:`attend` does both in one call."""

    executor: CachedExecutor
    selection: KVSelection
    name: str = "kv_cache"
    policy_state: Any = None  # the KV policy's state before the call (how many keys its heads read)
    keys_read: int | None = None  # the keys its heads read, when the policy counted them in the call

    @property
    def strategy(self) -> str:
        """``full`` (every group, no gathers), ``compact`` (the kept groups), ``full+<policy>`` / ``<policy>``
        (groups held by the KV policy too / only)."""
        sel = self.selection
        if sel.window_index is not None:
            name = sel.policy_name or "window"
            return f"full+{name}" if sel.slots else name
        return "full" if sel.identity else "compact"

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        return self.executor(weights, inputs, plan)

    def usage(self, s: Tensor, plan: HeadPlan, query_mask: Tensor | None, T: int, S: int,
              holds_unkept: bool) -> LastForward:
        """The call's usage record: ``s`` the request's budget, ``T`` queries, ``S`` keys; ``holds_unkept``: the KV
        policy computes the heads of the groups the plan does not keep (they count as streamed heads)."""
        sel, streamed, held_full = self.selection, None, None
        if sel.modes is not None and holds_unkept:
            # (B, Hkv) -> (B, H): every head of a group the plan does not keep that its KV policy holds; a policy
            # that keeps such groups in full (`full`) computes them over every key: computed heads, not streamed
            unkept = ~kv_groups_used(plan.active, sel.modes.shape[1])
            per_head = plan.num_heads // sel.modes.shape[1]
            streamed = ((sel.modes == KV_WINDOW) & unkept).repeat_interleave(per_head, dim=1)
            held_full = ((sel.modes == KV_FULL) & unkept).repeat_interleave(per_head, dim=1)
        window_keys = sel.window_keys if sel.window_keys is not None else (
            S if sel.policy is None else self.keys_read if self.keys_read is not None else
            sel.policy.keys_read(self.policy_state, T, S))
        return LastForward(s, plan, query_mask, T, S, self.name, self.strategy, streamed, window_keys, held_full)

    def attend(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, record: LastForward,
               holds_unkept: bool) -> tuple[Tensor, LastForward]:
        """``(y (B, T, D), the call's usage record)`` in one call (:meth:`CachedExecutor.attend`)."""
        return self.executor.attend(weights, inputs, plan, record, holds_unkept)


@register_executor("kv_cache")
class CachedExecutor:
    """A request's held sequence plan on a compact KV cache (``AttentionInputs.kv_cache``): only the kept key/value
    groups are projected, cached and read; groups the KV policy holds are attended by it; the others are never
    computed.

    It is the only executor that reads a compact cache (``capabilities.reads_kv_cache``): ``auto`` runs it on every
    cached call of a wrapped decoder (Llama, Qwen2/3, Mistral, Gemma, GPT-2, T5's decoder, BERT as a decoder), and a
    named executor that cannot is replaced by it on those calls with one warning (:func:`condcomp.explain` says why).
    On a call without a cache it computes the kept groups from the call's own keys and values, which ``auto`` never
    prefers (it projects every group); a per-token plan then keeps the groups any token reads (on a compact cache it
    is refused: a later token may pick any head).

    >>> import condcomp
    >>> "kv_cache" in condcomp.list_executors()
    True
    """

    name = "kv_cache"
    granularities = ("sequence", "token")
    capabilities = Capabilities(reads_kv_cache=True)

    def supports(self, weights: AttentionWeights | None, inputs: AttentionInputs, plan: HeadPlan,
                 cache: CompactKV | None = None) -> str | None:
        cache = cache if cache is not None else inputs.kv_cache
        if cache is not None and plan.granularity != "sequence":
            return ("a per-token plan may pick any head at a later token: it cannot run on a compact KV cache (one "
                    "head set per request)")
        return None

    def prepare(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Any:
        """Bound to a cached call (:class:`CachedRun`: its strategy and usage record), or itself without a cache."""
        cache = inputs.kv_cache
        return self if cache is None else CachedRun(self, cache.selection, policy_state=cache.policy_state())

    def attend(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, record: LastForward,
               holds_unkept: bool) -> tuple[Tensor, LastForward]:
        """``(y (B, T, D), the call's usage record)`` in one call: the call run on the compact cache it carries and
        ``record`` (the caller's ``s``, plan, query mask, ``T`` and ``S``) completed as :meth:`CachedRun.usage`
        does (``holds_unkept``: the KV policy computes the groups the plan does not keep). The decoder sequence
        holds the executor a request's first call resolved and runs each later call through this alone."""
        y, before, read = self._run(weights, inputs, plan)
        cache = inputs.kv_cache
        if cache is None:
            return y, LastForward(record.s, plan, record.mask, record.T, record.S, self.name)
        run = CachedRun(self, cache.selection, policy_state=before, keys_read=read)
        return y, run.usage(record.s, plan, record.mask, record.T, record.S, holds_unkept)

    def estimate(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Estimate:
        if inputs.kv_cache is not None:
            return Estimate(0.0, self.prepare(weights, inputs, plan),
                            note="the call reads a compact KV cache, which only this executor can")
        return Estimate(1.5, note="without a KV cache it projects every group and gathers the kept ones")

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
                 cache: CompactKV | None = None) -> Tensor:
        return self._run(weights, inputs, plan, cache)[0]

    def _run(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
             cache: CompactKV | None = None) -> tuple[Tensor, Any, int | None]:
        """The call's output, the KV policy's state before it as given and the keys its heads read as the policy
        counted them in the call (:func:`_compact_call`; both None without a cache)."""
        cache = cache if cache is not None else inputs.kv_cache
        reason = self.supports(weights, inputs, plan, cache)
        if reason is not None:
            raise RuntimeError(f"executor 'kv_cache' cannot run this call: {reason}")
        if cache is not None:
            if cache.projections is None:
                cache = dataclasses.replace(cache, projections=Projections.of_weights(weights))
            return _compact_call(weights.layout, inputs, cache)
        return keep_gates_in_graph(self._cache_free(weights, inputs, plan), plan), None, None

    def _cache_free(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        """The kept groups' attention from the call's own keys and values (every group projected, then gathered).
        A per-token plan keeps the groups any of its tokens reads, each (token, head) with its own gate."""
        L = weights.layout
        x = inputs.x
        B, T, _ = x.shape
        k_all, v_all = project_kv(weights, inputs)  # (B, Hkv, S, Dh), rotary and key norms applied
        S = k_all.shape[2]
        if plan.granularity == "token":  # the groups any token reads; their gates below, per token
            used = plan.active.any(1)  # (B, H)
            order = torch.argsort((~used).long(), dim=-1, stable=True)  # (B, H): used heads first, ascending
            union = HeadPlan("sequence", used.to(plan.gates.dtype), used, used.sum(-1), order, {})
            sel = select_kv(union, L)
        else:
            sel = select_kv(plan, L, detach=False)
        if sel.slots == 0:
            return x.new_zeros(B, T, L.d_model)
        proj = Projections.of_weights(weights)
        heads = _heads_of_slots(sel.kv_index, L.group_size)  # (B, g*r)
        q = _queries(_slots(proj.q(x).view(B, T, L.num_kv_heads, L.group_size, L.head_dim), sel.kv_index,
                            sel.identity), proj, inputs.rotary)  # (B, g*r, T, Dh)
        k = _slots(k_all.transpose(1, 2), sel.kv_index, sel.identity).transpose(1, 2)  # (B, g, S, Dh)
        v = _slots(v_all.transpose(1, 2), sel.kv_index, sel.identity).transpose(1, 2)
        am = build_attention_mask(inputs, L.causal, x.dtype)
        mask, slot_dead = _slot_mask(am, heads)
        out = grouped_sdpa(q, k, v, mask, am.is_causal and S == T, L.scale, inputs.dropout_p)  # (B, g*r, T, Dh)
        gates = sel.slot_gates
        if plan.granularity == "token":  # (B, g*r, T): each token's gate of each slot head, spare slots 0
            per_token = plan.gates.masked_fill(~plan.active, 0.0)  # (B, T, H)
            gates = per_token.gather(2, heads[:, None, :].expand(B, T, heads.shape[1])).transpose(1, 2)
            gates = gates * sel.slot_gates.unsqueeze(-1)
        y = proj.o(_combine([(_gated(out, gates, slot_dead), sel.kv_index)], L, sel.identity))
        active = (plan.counts > 0).view(B, -1, 1)  # (B, 1|T, 1): rows (tokens) with an active head get the bias
        y = torch.where(active, y, torch.zeros_like(y))
        dead = dead_rows(am, B, T)
        return y if dead is None else y.masked_fill(dead.unsqueeze(-1), 0.0)
