"""KV policies on a tiny Llama: ``kv=`` in the config, prefill and decode against each policy's rule written out
entry by entry, the cache's bytes by hand, row selection carrying a policy's state, and a test-only policy
(``sinks_only_policy.py``: one file plus registration) running through the whole cache path.

The reference is one forward over the whole sequence without a cache in which every wrapped layer is the per-head
reference loop with an additive float64-built bias from the rule, for the heads and modes the request's plan holds
(``condcomp.testing_kv.rule_logits``, the rule ``check_kv_policy`` also checks users' policies against).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import condcomp
from condcomp.kv import KV_FULL, KV_WINDOW
from condcomp.testing_kv import generate_by_hand as generate
from condcomp.testing_kv import rule_logits

t = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "integrations" / "hf"))
from decode_helpers import extend, llama, prompts, step  # noqa: E402
from sinks_only_policy import Sinks, SinksOnlyKV  # noqa: E402

NEW = 4
Rule = Callable[[int, int], bool]  # (query position, key position) -> may attend, for a group the policy holds


def wrapped(kv: Any, kv_heads: int = 4, router: Any = None) -> nn.Module:
    model = llama(kv_heads)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=router or ("topk", {"kv_groups": True}),
                                  kv=kv)
    condcomp.apply_(model, cfg)
    return model.eval()


CASES: dict[str, tuple[Any, Rule, set[str]]] = {
    "sinks_only": (("sinks_only", {"sinks": 2}), lambda p, j: j < 2, {"full", "sinks_only"}),
    "window": (("window", {"sinks": 1, "window": 3}), lambda p, j: j < 1 or p - j < 3, {"full", "window"}),
    "full": ("full", lambda p, j: True, {"full"}),
    "drop": ("drop", lambda p, j: False, {"full", "none"}),
}


@pytest.mark.parametrize("kv_heads", [8, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_kv_policy_prefill_and_decode_equal_its_rule_without_a_cache(case: str, kv_heads: int) -> None:
    kv, rule, modes = CASES[case]
    model = wrapped(kv, kv_heads)
    ids, mask = prompts()
    tokens, full_mask, logits, cache = generate(model, ids, mask, NEW)
    plans = condcomp.request_plans(model, cache)
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == modes
    ref = rule_logits(model, plans, tokens, full_mask, rule)
    P = ids.shape[1]
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, ref[:, P - 1 + i], atol=1e-4, rtol=1e-4)


def test_the_test_only_policy_state_is_counted_carried_through_row_selection_and_cropped() -> None:
    from condcomp.integrations.hf.cache import cache_bytes

    model = wrapped(("sinks_only", {"sinks": 2}))
    ids, mask = prompts()
    tokens, full_mask, logits, cache = generate(model, ids, mask, 1)
    B, S = tokens.shape
    Dh = model.config.hidden_size // model.config.num_attention_heads
    want = []
    for layer, plan in zip(cache.layers, condcomp.request_plans(model, cache).values()):
        assert isinstance(layer.condcomp_windows, Sinks)
        assert plan.kv_modes is not None
        g = int((plan.kv_modes == KV_FULL).sum(-1).max())
        gw = int((plan.kv_modes == KV_WINDOW).sum(-1).max())
        want.append(4 * 2 * B * g * S * Dh + 4 * 2 * B * gw * 2 * Dh + 8 * (B * 2 + B))  # by hand
    assert cache_bytes(cache) == want
    rows = torch.tensor([2, 0])
    cache.batch_select_indices(rows)
    tokens, full_mask = extend(tokens[rows], full_mask[rows], logits[-1][rows].argmax(-1, keepdim=True))
    got = step(model, tokens, full_mask, cache, 1)
    ref = rule_logits(model, condcomp.request_plans(model, cache), tokens, full_mask, lambda p, j: j < 2)
    torch.testing.assert_close(got, ref[:, -1], atol=1e-4, rtol=1e-4)
    cache.crop(-1)  # the last token leaves every layer, the sinks stay
    assert all(int(layer.condcomp_windows.seen.max()) == int(full_mask.sum(-1).max()) - 1 for layer in cache.layers)


def test_kv_config_field_round_trips_and_the_stream_window_shorthand_is_the_window_policy() -> None:
    cfg = condcomp.CondCompConfig(kv=("sinks_only", {"sinks": 3}))
    assert condcomp.CondCompConfig.from_json(cfg.to_json()) == cfg
    assert condcomp.CondCompConfig().kv == ("drop", {})  # the default keeps today's behaviour
    assert "sinks_only" in condcomp.list_kv_policies() and isinstance(SinksOnlyKV(), condcomp.KVPolicy)
    with pytest.raises(KeyError, match="unknown kv policy 'windw'; registered kv policies: .*window"):
        condcomp.CondCompConfig(kv="windw")
    with pytest.raises(TypeError, match="has no option 'width'"):
        condcomp.CondCompConfig(kv=("window", {"width": 3}))
    with pytest.raises(ValueError, match=r"window kv policy: window .* must be a whole number >= 1"):
        condcomp.CondCompConfig(kv=("window", {"window": 0}))
    for option in ("window", "sinks"):  # an OverflowError at the first call before (red team round 5)
        with pytest.raises(ValueError, match=rf"window kv policy: {option} .*kv='full'.* <= 1099511627776 \(2\*\*40\)"):
            condcomp.CondCompConfig(kv=("window", {option: 10**30}))
    with pytest.raises(ValueError, match="stream_window"):
        condcomp.CondCompConfig(router=("topk", {"stream_window": 3}), kv="full")
    ids, mask = prompts()
    policy = wrapped(("window", {"sinks": 1, "window": 3}))
    with pytest.warns(DeprecationWarning, match="kv=\\('window'"):
        shorthand = wrapped("drop", router=("topk", {"kv_groups": True, "stream_window": 3, "stream_sinks": 1}))
    for a, b in zip(generate(policy, ids, mask, NEW)[2], generate(shorthand, ids, mask, NEW)[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv_heads", [8, 4])
def test_the_full_policy_with_whole_group_plans_decodes_as_the_unwrapped_model(kv_heads: int) -> None:
    # the router keeps whole groups; "full" keeps the others at gate 1: every head, every token, as the dense model
    ids, mask = prompts()
    got = generate(wrapped("full", kv_heads), ids, mask, NEW)
    dense = generate(llama(kv_heads), ids, mask, NEW)
    assert torch.equal(got[0], dense[0])  # the same tokens
    for a, b in zip(got[2], dense[2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
