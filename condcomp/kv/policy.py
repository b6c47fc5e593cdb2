"""The KV policy: what a request's key/value group keeps in its cache when its plan does not keep it in full.

A decoder request's plan (decided at prefill, :mod:`condcomp.kv.selection`) keeps some key/value groups (GQA groups;
MHA: single heads) in full. The groups it does not keep get the layer's KV policy, the fourth role beside the budget
policy, the router and the executor, named by ``CondCompConfig(kv=...)``:

- ``drop`` (the default): the group is neither computed nor cached (its heads output zero);
- ``full``: the group is cached in full and its heads are computed with gate 1 (dense decoding: the baseline);
- ``window``: the group keeps its first ``sinks`` tokens and its last ``window`` tokens (StreamingLLM /
  DuoAttention's streaming heads), :class:`~condcomp.kv.window_policy.WindowKV`;
- anything registered with :func:`condcomp.register_kv_policy`: a :class:`KVPolicy` subclass that stores its groups
  in a state of its own and says how its heads attend over it.

A policy is data (frozen, compared by value) and owns everything about its state: how a call attends over it and
updates it (:meth:`KVPolicy.attend`), the cache operations on rows (:meth:`KVPolicy.take_rows`, :meth:`KVPolicy.crop`;
copies and pickling copy the state), how it is stored in a quantized cache (:meth:`KVPolicy.stored`) and what it
costs in bytes (:meth:`KVPolicy.tensors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from condcomp.registry import register_kv_policy

KV_NONE, KV_WINDOW, KV_FULL = 0, 1, 2  # a request's KV group: not cached, a policy's own state, the full cache
KV_MODE_NAMES = ("none", "window", "full")


class KVPolicy:
    """Base of the KV policies: ``stores`` says where the groups it gets live.

    - ``"none"``: nowhere (dropped); ``"full"``: in the full-length cache beside the kept groups, heads at gate 1;
    - ``"own"``: in a state of the policy's own, one per layer for the batch's groups it gets
      (``(B, gw, ...)``, rows in cache order). Such a policy implements :meth:`attend`, and :meth:`take_rows`,
      :meth:`crop` and :meth:`tensors` on its state unless the state has ``take_rows`` / ``crop`` / ``tensors``.

    Subclasses are frozen dataclasses registered with :func:`condcomp.register_kv_policy`; their options are the
    dataclass fields. A policy that is not a dataclass compares by type.
    """

    stores: ClassVar[str] = "own"
    # attend gets ``slot_valid=`` (B, gw) bool, which of its slots hold a group of the row (the others are spare
    # slots repeating one, gate 0): a policy that chooses across a row's groups jointly must skip spare slots
    reads_slot_validity: ClassVar[bool] = False
    # attend gets ``slot_groups=`` (B, gw) int64, the KV group each of its slots holds
    # (:attr:`~condcomp.kv.selection.KVSelection.window_index`): a policy whose options differ per group reads it
    reads_slot_groups: ClassVar[bool] = False
    # attend gets ``position_bias=`` (a :class:`~condcomp.kv.position_bias.RelativeBias` narrowed to its slots'
    # heads) on a model that adds a relative position bias to its scores (T5's decoder); a policy that cannot add it
    # is refused on such a model
    reads_position_bias: ClassVar[bool] = False
    # its groups hold a fixed number of slots once the prefill is done (a window, a selection plus room for the
    # tokens to come): on a static cache its state is preallocated at prefill (:meth:`fixed_slots`) and a decode
    # step compiles; a policy without it is refused on a static cache by name
    holds_fixed_slots: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """The registry key (the class name when unregistered)."""
        return str(getattr(type(self), "registry_key", type(self).__name__))

    @property
    def mode(self) -> int:
        """The mode code a group under this policy carries in ``KVSelection.modes``."""
        return {"none": KV_NONE, "full": KV_FULL}.get(self.stores, KV_WINDOW)

    @property
    def needs_cache(self) -> bool:
        """Whether its groups differ from a plan without a cache (where unkept groups are skipped)."""
        return self.stores != "none"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, query_mask: Tensor | None, scale: float,
               keep: bool) -> tuple[Tensor, Tensor, Any]:
        """One call over the policy's groups: ``q (B, gw*r, T, Dh)``, this call's ``k``/``v (B, gw, T, Dh)``
        (after rotary), ``state`` before the call (None at prefill), ``query_mask (B, T)`` real tokens or None.
        Returns ``(out (B, gw*r, T, Dh), dead (B, 1, T) queries that see no key, new state or None if not keep)``.
        A policy with ``reads_slot_validity = True`` is also given the keyword ``slot_valid (B, gw)`` bool (see
        :attr:`~condcomp.kv.selection.KVSelection.window_valid`); others are called without it. One with
        ``reads_slot_groups = True`` is given ``slot_groups (B, gw)`` int64, the KV group of each slot. One with
        ``reads_position_bias = True`` is given ``position_bias`` (a
        :class:`~condcomp.kv.position_bias.RelativeBias` of its ``gw*r`` query heads, or None): it adds the bias of
        each query's and kept key's true positions to their score."""
        raise NotImplementedError(f"KV policy {self.name!r} stores {self.stores!r}: it holds no state to attend")

    def keys_read(self, state: Any, T: int, S: int) -> int:
        """The most keys one of its heads reads in a call of ``T`` queries over ``S`` keys, given its ``state``
        before the call (None at prefill): what ``head_usage`` counts its FLOPs over. Default: every key."""
        return S

    def take_rows(self, state: Any, index: Tensor) -> Any:
        """The state of rows ``index`` (int64 or bool over rows), in that order (beam reordering, selecting,
        repeating rows)."""
        return state.take_rows(index)

    def crop(self, state: Any, tokens: int) -> Any:
        """The state without each request's last ``tokens`` tokens (or an error saying why it cannot be)."""
        return state.crop(tokens)

    def tensors(self, state: Any) -> tuple[Tensor, ...]:
        """Every tensor the state holds: what it costs in bytes (``condcomp.integrations.hf.cache_bytes``)."""
        return tuple(state.tensors())

    def within_model_window(self, sliding_window: int) -> KVPolicy:
        """The policy on a layer whose model attends only the last ``sliding_window`` keys (Mistral's
        ``sliding_window``): its groups must not read keys the model's own rule excludes. Policies that store
        nothing of their own (``drop``, ``full``: the model's mask applies) are unchanged; one that keeps a state
        of its own says how it honours the model's window by overriding this, and is refused otherwise."""
        if self.stores != "own":
            return self
        raise ValueError(
            f"the KV policy {self.name!r} keeps the groups a plan does not keep in a state of its own, but cannot "
            f"apply this layer's own sliding window ({sliding_window} tokens): its groups would read keys the model "
            "never attends. On a sliding-window model use kv='window', 'full' or 'drop', or give the policy a "
            "within_model_window method")

    def fixed_slots(self, state: Any, room: int) -> Any:
        """The prefill's ``state`` moved into storage allocated once (:mod:`condcomp.kv.fixed_slots`), with room for
        ``room`` more tokens, written in place by every later call: how a static cache holds it (only for a policy
        with ``holds_fixed_slots``)."""
        raise NotImplementedError(f"the KV policy {self.name!r} cannot hold its groups in preallocated slots")

    def check_layout(self, num_kv_groups: int) -> None:
        """Refuse settings that do not fit a layer of ``num_kv_groups`` key/value groups (called once per wrapped
        layer, when its policy is built). Default: every policy fits every layer."""

    def stored(self, state: Any, codec: Any, before: Any) -> Any:
        """The state as a quantized cache layer should hold it (``codec``: the layer's
        :class:`~condcomp.kv.window_quant.WindowCodec`; ``before``: what it held). Default: as is."""
        return state

    def loaded(self, stored: Any) -> Any:
        """The state an executor reads from what :meth:`stored` returned."""
        return stored

    # ---- this policy's state in a cache layer (condcomp.kv.layer.CompactLayer): the executor enters the policy
    # once per call (attend_in), which reads, attends over and keeps the state there, so a decode step reads down
    # (executor -> policy -> cache layer); the layer's policy_state / keep_policy_state read and keep it the same way
    def attend_in(self, layer: Any, q: Tensor, k: Tensor, v: Tensor, query_mask: Tensor | None, scale: float,
                  keys: int, **options: Any) -> tuple[Tensor, Tensor, int]:
        """One call over its groups whose state the cache ``layer`` holds, in one entry: the state read
        (:meth:`state_in`), attended with this call's keys (:meth:`attend`, given ``options``: its opt-in keywords
        such as ``slot_valid``), the new state kept in the layer (:meth:`keep_in`) and the keys its heads read
        counted (:meth:`keys_read` of the state before the call; ``keys``: the call's ``S``, what a head reading
        every key reads). Returns ``(out (B, gw*r, T, Dh), dead (B, 1, T), keys read)``. The executor calls it; a
        policy overrides :meth:`attend` (and :meth:`loaded`, :meth:`stored`, :meth:`fixed_slots`,
        :meth:`keys_read`), not this."""
        before = self.state_in(layer)
        out, dead, state = self.attend(q, k, v, before, query_mask, scale, True, **options)
        self.keep_in(layer, state)
        return out, dead, self.keys_read(before, q.shape[2], keys)

    def state_in(self, layer: Any) -> Any:
        """The state ``layer`` holds for this policy before a call, as :meth:`attend` reads it (None: none yet)."""
        held = layer.condcomp_windows
        return None if held is None else self.loaded(held)

    def keep_in(self, layer: Any, state: Any) -> None:
        """Keep ``state`` in ``layer`` as this policy stores it there: quantized when the layer quantizes its keys
        (:meth:`stored` with the layer's ``condcomp_codec``, read as data), moved into fixed slots in preallocated
        storage (the prefill's, :meth:`fixed_slots`; later calls write those slots in place and keep them as they
        are)."""
        before = layer.condcomp_windows
        if state is not None and state is before:  # preallocated state, written in place
            return
        if state is not None:
            room = None if layer.condcomp_preallocated is False else layer.fixed_slot_room()
            if room is not None:  # a static cache: the prefill's state moves into slots allocated once
                state = self.fixed_slots(state, room)
            state = self.stored(state, layer.condcomp_codec, before)
        layer.hold_state(state)


@register_kv_policy("drop")
@dataclass(frozen=True)
class DropKV(KVPolicy):
    """The groups a plan does not keep are neither computed nor cached (the default)."""

    stores: ClassVar[str] = "none"


@register_kv_policy("full")
@dataclass(frozen=True)
class FullKV(KVPolicy):
    """The groups a plan does not keep are cached in full and computed with gate 1: dense decoding, a baseline
    that holds every group (the plan then only decides which heads of the kept groups are skipped)."""

    stores: ClassVar[str] = "full"
