"""A user's KV policy, written against the extension protocol of ``docs/extending-kv.md`` and defined here, runs
unchanged now that the executor enters a policy once per decode call (``KVPolicy.attend_in``: the state read from
the cache layer, attended, kept there): one implementing only ``attend``, and one adding the optional ``loaded`` /
``stored`` / ``keys_read``. Both decode to the per-head reference loop masked by the policy's rule (built in
float64, ``condcomp.testing_kv.rule_logits``); the hooks run as many times as counted by hand, the layer holds the
stored form, and the usage record counts the keys read from the state before each call. What a decode step reads of
the policy (``holds_unkept``, ``policy_name``, ``window_keys``) is data of the selection, checked by hand.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import condcomp
from condcomp.api import routed_modules
from condcomp.dense import grouped_sdpa
from condcomp.executors.cached import CompactKV
from condcomp.testing_kv import generate_by_hand, rule_logits

t = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "integrations" / "hf"))
from decode_helpers import extend, llama, prompts, step  # noqa: E402

NEW = 3


@dataclass(frozen=True)
class Evens:
    """``keys``/``values (B, gw, n, Dh)``: the tokens at even real-token positions; ``positions (B, n)`` (-1: empty);
    ``seen (B,)`` real tokens so far."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    seen: Tensor


@dataclass(frozen=True)
class Packed:
    """The form :class:`HookedKV` stores its state in a cache layer (``stored``), unwrapped by ``loaded``."""

    state: Evens


@dataclass(frozen=True)
class EvenTokensKV(condcomp.KVPolicy):
    """The groups a plan does not keep hold their request's tokens at even positions; a query at real-token
    position ``p`` reads keys ``j <= p`` with ``j`` even. Only ``attend``, as the docs' example."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Evens | None, query_mask: Tensor | None,
               scale: float, keep: bool) -> tuple[Tensor, Tensor, Evens | None]:
        B, gw, T, Dh = k.shape
        real = torch.ones(B, T, dtype=torch.bool) if query_mask is None else query_mask.bool()
        before = torch.zeros(B, dtype=torch.long) if state is None else state.seen
        pos = (before.unsqueeze(-1) + real.long().cumsum(-1) - 1).masked_fill(~real, -1)  # (B, T)
        if state is not None:
            k, v = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)
        key_pos = pos if state is None else torch.cat([state.positions, pos], 1)  # (B, N)
        even = (key_pos >= 0) & (key_pos % 2 == 0)  # (B, N)
        allowed = even[:, None, :] & (key_pos[:, None, :] <= pos[:, :, None])  # (B, T, N)
        dead = ~allowed.any(-1)  # (B, T): padding queries
        out = grouped_sdpa(q, k, v, (allowed | dead.unsqueeze(-1)).unsqueeze(1), False, scale)
        if not keep:
            return out, dead.unsqueeze(1), None
        n = int(even.sum(-1).max())
        chosen = (~even).long().argsort(dim=-1, stable=True)[:, :n]  # (B, n): each row's even entries first, in order
        index = chosen[:, None, :, None].expand(B, gw, n, Dh)
        kept = key_pos.gather(1, chosen).masked_fill(~even.gather(1, chosen), -1)
        seen = torch.maximum(before, pos.amax(-1) + 1)
        return out, dead.unsqueeze(1), Evens(k.gather(2, index), v.gather(2, index), kept, seen)


HOOKS: list[str] = []  # the optional hooks HookedKV ran, in order


@dataclass(frozen=True)
class HookedKV(EvenTokensKV):
    """The same rule, with the optional hooks: its state is stored wrapped and loaded unwrapped."""

    def stored(self, state: Any, codec: Any, before: Any) -> Any:
        HOOKS.append("stored")
        return Packed(state)

    def loaded(self, stored: Any) -> Any:
        HOOKS.append("loaded")
        assert isinstance(stored, Packed), f"loaded() got {type(stored).__name__}, not what stored() returned"
        return stored.state

    def keys_read(self, state: Any, T: int, S: int) -> int:
        return S if state is None else int(state.keys.shape[2]) + T


def wrapped(name: str, policy: type) -> Any:
    # a subclass registered under ``name`` (registering sets its class's registry key: the classes here stay as
    # written, unregistered)
    condcomp.register_kv_policy(name)(dataclass(frozen=True)(type(policy.__name__, (policy,), {})))
    model = llama(4)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}), kv=name))
    return model.eval()


def even_rule(p: int, j: int) -> bool:
    return j % 2 == 0


@pytest.mark.parametrize("policy", [EvenTokensKV, HookedKV])
def test_a_users_policy_decodes_to_its_rule_through_the_one_entry(policy: type, restore_registries: None) -> None:
    name = f"test_{policy.__name__.lower()}"
    model = wrapped(name, policy)
    HOOKS.clear()
    ids, mask = prompts()
    tokens, full_mask, logits, cache = generate_by_hand(model, ids, mask, NEW)
    plans = condcomp.request_plans(model, cache)
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == {"full", name}  # not vacuous
    ref = rule_logits(model, plans, tokens, full_mask, even_rule)
    P = ids.shape[1]
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, ref[:, P - 1 + i], atol=1e-4, rtol=1e-4)
    layers = len(cache.layers)
    if policy is HookedKV:  # by hand: the prefill stores in each layer; each decode call loads, then stores
        assert HOOKS == ["stored"] * layers + ["loaded", "stored"] * layers * NEW
        assert all(isinstance(layer.condcomp_windows, Packed) for layer in cache.layers)
    else:
        assert HOOKS == [] and all(isinstance(layer.condcomp_windows, Evens) for layer in cache.layers)
    usage = condcomp.head_usage(model)
    assert {u.strategy for u in usage.values()} == {f"full+{name}"}  # the policy's name, held as data


def test_the_usage_record_counts_the_keys_read_from_the_state_before_the_call(restore_registries: None) -> None:
    model = wrapped("test_hooked_usage", HookedKV)
    ids, mask = prompts()
    cache = t.DynamicCache()
    with torch.no_grad():
        logits = step(model, ids, mask, cache, ids.shape[1])
        tokens = ids
        for _ in range(NEW):
            seen = mask.sum(-1)  # (B,) real tokens before this call
            tokens, mask = extend(tokens, mask, logits.argmax(-1, keepdim=True))
            logits = step(model, tokens, mask, cache, 1)
            # by hand: the most even positions among a row's tokens so far, plus the call's own token
            want = int(((seen + 1) // 2).max()) + 1
            for routed in routed_modules(model).values():
                assert routed.last is not None and routed.last.window_keys == want
    layer = cache.layers[0]
    compact = CompactKV(layer.condcomp_plan.selection, layer.store, state_layer=layer)
    assert isinstance(compact.policy_state(), Evens)  # read through the policy's loaded(), wherever it is held


def test_what_a_decode_step_reads_of_the_policy_is_data_of_the_selection() -> None:
    from condcomp.kv.selection import pad_slots, select_kv
    from condcomp.types import HeadLayout

    layout = HeadLayout(d_model=16, num_heads=8, num_kv_heads=4, head_dim=2, scale=0.5)
    active = torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0], [1, 0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)  # 3 and 2 groups
    plan = condcomp.plan_from_active(active)
    window = condcomp.kv.WindowKV(sinks=2, window=5)
    cases = {  # policy -> (holds_unkept, policy_name, window_keys), by hand
        "drop": (None, (False, None, None)),
        "full": (condcomp.kv.FullKV(), (True, None, None)),  # held in the full cache: no policy slots
        "window": (window, (True, "window", 7)),
        "user": (EvenTokensKV(), (True, "EvenTokensKV", None)),  # unregistered: the class name
    }
    for what, (policy, want) in cases.items():
        sel = select_kv(plan, layout, policy)
        for s in (sel, pad_slots(sel, sel.slots + 1),
                  condcomp.kv.HeldPlan(plan, sel, 4).take_rows(torch.tensor([1])).selection,
                  pickle.loads(pickle.dumps(sel))):
            assert s is not None and (s.holds_unkept, s.policy_name, s.window_keys) == want, what
    # a selection pickled before these were data: the policy holding its own slots says it holds the unkept groups
    sel = select_kv(plan, layout, window)
    old = {k: v for k, v in sel.__dict__.items() if k not in ("holds_unkept", "policy_name", "window_keys")}
    again = sel.__class__.__new__(sel.__class__)
    again.__setstate__(old)
    assert (again.holds_unkept, again.policy_name, again.window_keys) == (True, "window", 7)
    for policy, holds in ((condcomp.kv.FullKV(), True), (None, False)):  # `full` caches every group; `drop` does not
        sel = select_kv(plan, layout, policy)
        old = {k: v for k, v in sel.__dict__.items() if k not in ("holds_unkept", "policy_name", "window_keys")}
        again = sel.__class__.__new__(sel.__class__)
        again.__setstate__(old)
        assert again.holds_unkept is holds
