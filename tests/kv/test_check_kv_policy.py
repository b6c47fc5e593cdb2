"""``condcomp.testing.check_kv_policy``: docs/extending-kv.md's policy and the built-in ones pass it against their
rules written out entry by entry; a policy broken in one way at a time fails with a message naming that check."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import condcomp
from condcomp.registry import KV_POLICIES
from condcomp.testing import check_kv_policy
from condcomp.user_spec import load_attribute

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from docs_kv_example import save_docs_policy  # noqa: E402

FIRST_TWO = lambda p, j: j < 2  # noqa: E731 - the docs policy's rule at sinks=2: keys at real positions 0 and 1


@pytest.fixture
def kv_registry() -> Iterator[None]:
    saved = dict(KV_POLICIES._entries)
    KV_POLICIES._entries.pop("first_tokens", None)  # the docs gate may have run the page's block
    yield
    KV_POLICIES._entries.clear()
    KV_POLICIES._entries.update(saved)


@pytest.fixture
def docs_policy(tmp_path: Path, kv_registry: None) -> Any:
    return load_attribute(f"{save_docs_policy(tmp_path)}:FirstTokensKV", "test", "")


def test_the_docs_policy_passes_against_its_rule_and_its_own_prefill(docs_policy: Any) -> None:
    check_kv_policy(docs_policy, {"sinks": 2}, rule=FIRST_TWO)
    check_kv_policy("first_tokens", {"sinks": 3})  # by name; decode against one prefill through the policy
    wrong = r"the prefill through the cache differs from the rule's reference .*rows \[0, 1\]"
    with pytest.raises(AssertionError, match=wrong):
        check_kv_policy(docs_policy, {"sinks": 3}, rule=FIRST_TWO)  # the check can fail: a rule it does not follow


def test_the_builtin_window_policy_passes_against_its_rule() -> None:
    check_kv_policy("window", {"sinks": 1, "window": 3}, rule=lambda p, j: j < 1 or p - j < 3)


@pytest.mark.parametrize("name", ["adakv", "drop", "full", "headkv", "snapkv", "window"])
def test_every_builtin_policy_passes_with_its_defaults(name: str) -> None:
    assert name in condcomp.list_kv_policies()
    check_kv_policy(name)


def subclass(base: Any, **methods: Any) -> Any:
    """``base`` with ``methods`` replaced, registered as ``broken`` (one broken thing per test)."""
    cls = dataclass(frozen=True)(type("Broken", (base,), dict(methods)))
    return condcomp.register_kv_policy("broken", override=True)(cls)


def test_state_that_ignores_left_padding_fails_naming_the_rows(docs_policy: Any) -> None:
    def attend(self: Any, q: Any, k: Any, v: Any, state: Any, query_mask: Any, scale: float, keep: bool) -> Any:
        out, dead, new = docs_policy.attend(self, q, k, v, state, query_mask, scale, keep)
        if new is None or state is not None:
            return out, dead, new
        n = new.keys.shape[2]  # the old page's "simple, not compact" state: the first columns, padding or not
        pos = (query_mask.long().cumsum(-1) - 1).masked_fill(~query_mask.bool(), -1)[:, :n]
        return out, dead, type(new)(k[:, :, :n].clone(), v[:, :, :n].clone(), pos.masked_fill(pos >= self.sinks, -1),
                                    new.seen)

    with pytest.raises(AssertionError, match=r"'broken': decode step 1 .* rows \[1, 2\].*left-padded"):
        check_kv_policy(subclass(docs_policy, attend=attend), {"sinks": 2}, rule=FIRST_TWO)


def test_a_state_of_views_fails_the_memory_check(docs_policy: Any) -> None:
    def attend(self: Any, *args: Any, **kwargs: Any) -> Any:
        out, dead, new = docs_policy.attend(self, *args, **kwargs)
        if new is None:
            return out, dead, new
        wide = torch.cat([new.keys, new.keys], 2)  # a slice of a wider tensor: its whole storage stays alive
        return out, dead, type(new)(wide[:, :, :new.keys.shape[2]], new.values, new.positions, new.seen)

    with pytest.raises(AssertionError, match=r"is a view of a \d+-byte storage .*\.clone\(\)"):
        check_kv_policy(subclass(docs_policy, attend=attend), {"sinks": 2}, rule=FIRST_TWO)


def test_uncounted_tensors_fail_the_bytes_check(docs_policy: Any) -> None:
    def tensors(self: Any, state: Any) -> tuple[torch.Tensor, ...]:
        return state.keys, state.values  # positions and seen left out

    with pytest.raises(AssertionError, match=r"layer 0: tensors\(state\) leaves out .* shapes \[\(3, 2\), \(3,\)\]"):
        check_kv_policy(subclass(docs_policy, tensors=tensors), {"sinks": 2}, rule=FIRST_TWO)


def test_row_selection_that_ignores_the_index_fails(docs_policy: Any) -> None:
    def take_rows(self: Any, state: Any, index: torch.Tensor) -> Any:
        return state.take_rows(torch.arange(len(index)))  # the first rows, not the ones asked for

    with pytest.raises(AssertionError, match=r"after batch_select_indices \(rows \[2, 0\]\).*take_rows"):
        check_kv_policy(subclass(docs_policy, take_rows=take_rows), {"sinks": 2}, rule=FIRST_TWO)


def test_a_wrong_crop_fails_and_a_refused_one_warns(docs_policy: Any) -> None:
    def crop(self: Any, state: Any, tokens: int) -> Any:
        return type(state)(state.keys, state.values, state.positions, state.seen)  # forgets nothing

    with pytest.raises(AssertionError, match=r"after cache.crop\(-1\), the same token again gives other logits"):
        # row 2's last token (real position 5) is among its first 7: the uncropped state still holds it
        check_kv_policy(subclass(docs_policy, crop=crop), {"sinks": 7}, rule=lambda p, j: j < 7)

    def refuse(self: Any, state: Any, tokens: int) -> Any:
        raise ValueError("broken: cannot crop; start the request again")

    with pytest.warns(UserWarning, match="crop is refused"):
        check_kv_policy(subclass(docs_policy, crop=refuse), {"sinks": 2}, rule=FIRST_TWO)


def test_keys_read_must_be_an_int_within_the_keys(docs_policy: Any) -> None:
    with pytest.raises(AssertionError, match=r"keys_read\(state, T=6, S=6\) returned 7"):
        check_kv_policy(subclass(docs_policy, keys_read=lambda self, state, T, S: S + 1), {"sinks": 2})


def test_unknown_names_and_bad_options_are_named() -> None:
    with pytest.raises(KeyError, match="registered kv policies: .*window"):
        check_kv_policy("windw")
    with pytest.raises(AssertionError, match=r"KV policy 'window': building it with options \{'width': 3\} failed"):
        check_kv_policy("window", {"width": 3})
