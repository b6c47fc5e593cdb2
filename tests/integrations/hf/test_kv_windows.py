"""Streamed key/value groups on a tiny Llama: prefill and decode against the rule, the cache's bytes by hand.

The ``topk`` router's ``stream_window`` makes the groups a request's plan does not keep stream (the first
``stream_sinks`` tokens and the last ``stream_window`` tokens) instead of dropping them. The reference is one
forward over the whole sequence without a cache in which every wrapped layer is the per-head reference loop with an
additive bias written out entry by entry from the rule, for the heads and modes the request's plan holds.
"""

from __future__ import annotations

import pytest
import torch
from decode_helpers import extend, llama, prompts, step
from torch import nn

import condcomp
from condcomp.kv.selection import KV_WINDOW, RequestPlan
from condcomp.testing_kv import generate_by_hand as generate
from condcomp.testing_kv import rule_logits

t = pytest.importorskip("transformers")

SINKS, WINDOW, NEW = 1, 3, 4


def streaming(kv_heads: int, fraction: float = 0.5, window: int = WINDOW) -> nn.Module:
    model = llama(kv_heads)
    router = ("topk", {"kv_groups": True, "stream_window": window, "stream_sinks": SINKS})
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}), router=router))
    return model.eval()


def reference_logits(model: nn.Module, plans: dict[str, RequestPlan], tokens: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """One cache-free forward: causal over real tokens; a streamed group's heads also within the sinks or the
    recent window (condcomp.testing_kv's float64-built rule)."""
    return rule_logits(model, plans, tokens, mask, lambda p, q: q < SINKS or p - q < WINDOW)


@pytest.mark.parametrize("kv_heads,long_prompt", [(8, False), (4, False), (4, True)])
def test_streamed_groups_prefill_and_decode_equal_the_rule_without_a_cache(kv_heads: int, long_prompt: bool) -> None:
    model = streaming(kv_heads)
    ids, mask = prompts()
    if long_prompt:  # longer than two windows: the prefill is computed block by block (banded_attention)
        ids = torch.cat([ids, torch.randint(1, 97, (ids.shape[0], 13), generator=torch.Generator().manual_seed(5))], 1)
        mask = torch.cat([mask, torch.ones(mask.shape[0], 13, dtype=mask.dtype)], 1)
    tokens, full_mask, logits, cache = generate(model, ids, mask, NEW)
    plans = condcomp.request_plans(model, cache)
    modes = {m for p in plans.values() for row in p.group_modes() for m in row}
    assert modes == {"full", "window"}  # each layer's plan keeps some groups in full and streams the others
    assert any(len({tuple(r) for r in p.group_modes()}) > 1 for p in plans.values())  # rows differ
    ref = reference_logits(model, plans, tokens, full_mask)
    P = ids.shape[1]
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, ref[:, P - 1 + i], atol=1e-4, rtol=1e-4)


def test_the_cache_holds_the_full_groups_and_each_streamed_groups_window_and_cache_bytes_counts_them() -> None:
    from condcomp.integrations.hf.cache import cache_bytes

    model = streaming(4)
    ids, mask = prompts()
    tokens, _, _, cache = generate(model, ids, mask, NEW)
    B, S = tokens.shape
    Dh = model.config.hidden_size // model.config.num_attention_heads
    plans = list(condcomp.request_plans(model, cache).values())
    want = []
    for plan in plans:  # by hand: g full groups (the most any row keeps) at every token, gw windows of SINKS+WINDOW
        assert plan.kv_modes is not None
        g = int((plan.kv_modes == 2).sum(-1).max())
        gw = int((plan.kv_modes == KV_WINDOW).sum(-1).max())
        n = min(S, SINKS + WINDOW)
        want.append(4 * 2 * B * max(g, 1) * S * (Dh if g else 1) + 4 * 2 * B * gw * n * Dh + 8 * (B * n + B))
    assert cache_bytes(cache) == want
    dense_cache = generate(llama(4), ids, mask, NEW)[3]
    assert cache_bytes(dense_cache) == [4 * 2 * B * 4 * S * Dh] * 2  # float32 keys and values, 4 groups, 2 layers


def test_selecting_rows_carries_the_windows_and_cache_free_generation_is_refused() -> None:
    model = streaming(4)
    ids, mask = prompts()
    tokens, full_mask, logits, cache = generate(model, ids, mask, 1)
    rows = torch.tensor([2, 0])
    cache.batch_select_indices(rows)
    tokens, full_mask = extend(tokens[rows], full_mask[rows], logits[-1][rows].argmax(-1, keepdim=True))
    got = step(model, tokens, full_mask, cache, 1)
    plans = condcomp.request_plans(model, cache)
    ref = reference_logits(model, plans, tokens, full_mask)
    torch.testing.assert_close(got, ref[:, -1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="stream"), condcomp.plan_from_prompt(model, ids.shape[1]):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, use_cache=False, do_sample=False,
                       pad_token_id=0)


def test_head_usage_reports_the_decode_step_and_the_kv_cache_executor() -> None:
    model = streaming(4)
    ids, mask = prompts()
    generate(model, ids, mask, 1)
    usage = condcomp.head_usage(model)
    assert usage and all(u.executor == "kv_cache" for u in usage.values())
    for routed in condcomp.api.routed_modules(model).values():
        assert routed.last is not None and routed.last.T == 1 and routed.last.S == ids.shape[1] + 1


def test_crop_before_the_window_is_outgrown_continues_like_the_reference_and_a_crop_into_evicted_is_refused() -> None:
    model = streaming(4, window=12)  # 1 + 12 tokens: nothing evicted within this test's 6 + 2 tokens
    ids, mask = prompts()
    tokens, full_mask, logits, cache = generate(model, ids, mask, 2)
    cache.crop(-1)  # forget the last token, then feed it again
    got = step(model, tokens, full_mask, cache, 1)
    torch.testing.assert_close(got, logits[-1], atol=1e-5, rtol=1e-5)
    model = streaming(4)  # 1 + 3 tokens: the 6-token prompts already evicted some
    tokens, full_mask, logits, cache = generate(model, ids, mask, 1)
    with pytest.raises(ValueError, match="evicted"):  # the next query (at 5) would read the evicted token 3
        cache.crop(-2)
    assert cache.get_seq_length() == tokens.shape[1]  # refused before anything changed


def test_head_usage_counts_streamed_heads_as_computed_over_their_window() -> None:
    """A streamed head still runs (over at most SINKS + WINDOW keys): ``k_frac`` counts it, ``streamed_frac`` says
    which part streamed, and ``flop_frac`` matches FLOPs counted by hand per head (q, scores, values, output per
    query row; key/value projections per cached group) over the dense block's."""
    from condcomp.flops import routing_flops

    model = streaming(4)
    ids, mask = prompts()
    _, _, _, cache = generate(model, ids, mask, 1)
    cfg = model.config
    D, H, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    Dh, r = D // H, H // Hkv
    T, S = 1, ids.shape[1] + 1
    n = min(S, SINKS + WINDOW)
    usage = condcomp.head_usage(model)
    for name, plan in condcomp.request_plans(model, cache).items():
        assert plan.kv_modes is not None
        full, streamed = (plan.kv_modes == 2).sum(-1), (plan.kv_modes == KV_WINDOW).sum(-1)  # groups per row
        assert bool(((full + streamed) == Hkv).all())  # fraction 0.5 with stream_window: nothing is dropped
        u = usage[name]
        assert u.k_frac == pytest.approx(1.0)
        assert u.streamed_frac == pytest.approx(float(streamed.float().mean()) / Hkv)
        per_row = [T * (int(f) * r * (2 * D * Dh + 4 * S * Dh + 2 * Dh * D)) + int(f) * 2 * S * 2 * D * Dh
                   + T * (int(w) * r * (2 * D * Dh + 4 * n * Dh + 2 * Dh * D)) + int(w) * 2 * n * 2 * D * Dh
                   for f, w in zip(full.tolist(), streamed.tolist())]
        dense = 2 * T * D * H * Dh + 2 * S * 2 * D * Hkv * Dh + 2 * T * H * Dh * D + 4 * T * S * H * Dh
        routed = condcomp.api.routed_modules(model)[name]
        extra = routing_flops(routed.condcomp_policy, T) + routing_flops(routed.condcomp_router, T)
        want = (sum(per_row) + extra * len(per_row)) / (dense * len(per_row))
        assert u.flop_frac == pytest.approx(want, rel=1e-9)
        assert u.flop_frac < 1.0  # the windows read fewer keys than the full context


def test_head_usage_counts_the_full_policys_groups_as_computed_heads_not_streamed() -> None:
    """With ``kv="full"`` the groups a plan does not keep are computed over every key: they count in ``k_frac`` and
    in ``flop_frac`` as full heads (the hand count of the dense block), and none of them is "streamed"."""
    from condcomp.flops import routing_flops

    model = llama(4)
    router = ("topk", {"kv_groups": True})
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=router, kv="full"))
    model.eval()
    ids, mask = prompts()
    _, _, _, cache = generate(model, ids, mask, 1)
    cfg = model.config
    D, H, Hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    Dh, T, S = D // H, 1, ids.shape[1] + 1
    dense = 2 * T * D * H * Dh + 2 * S * 2 * D * Hkv * Dh + 2 * T * H * Dh * D + 4 * T * S * H * Dh
    for name, u in condcomp.head_usage(model).items():
        routed = condcomp.api.routed_modules(model)[name]
        extra = routing_flops(routed.condcomp_policy, T) + routing_flops(routed.condcomp_router, T)
        assert u.k_frac == pytest.approx(1.0) and u.streamed_frac == 0.0
        assert u.flop_frac == pytest.approx((dense + extra) / dense, rel=1e-9)
