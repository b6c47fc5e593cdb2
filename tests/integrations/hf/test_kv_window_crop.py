"""Cropping a KV cache whose streamed groups outgrew their window, and what ``cache_bytes`` counts after a crop.

Once a request outgrew its window, ``crop(0)`` is a no-op (assisted decoding calls it), a crop that takes back only
tokens the windows still hold continues as the streaming rule says, cropping the whole cache starts a new request,
and only a crop into evicted tokens is refused. Oracles: the rule written from scratch in float64
(:mod:`window_rule`), the same decode without the crop or without the assistant, and bytes counted by hand.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from condcomp.integrations.hf.cache import cache_bytes
from decode_helpers import extend, llama, positions, prompts, step
from torch import nn
from window_rule import rule_logits

import condcomp
from condcomp.kv.selection import KV_FULL, KV_WINDOW

t = pytest.importorskip("transformers")

SINKS, WINDOW = 1, 3


def streaming(window: int = WINDOW, seed: int = 0) -> nn.Module:
    model = llama(4, seed=seed)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"kv_groups": True}),
                                  kv=("window", {"sinks": SINKS, "window": window}))
    condcomp.apply_(model, cfg)
    return model.eval()


@torch.no_grad()
def decode(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int, cache: Any = None
           ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], Any]:
    cache = t.DynamicCache() if cache is None else cache
    logits = [step(model, ids, mask, cache, ids.shape[1])]
    tokens = ids
    for _ in range(new):
        tokens, mask = extend(tokens, mask, logits[-1].argmax(-1, keepdim=True))
        logits.append(step(model, tokens, mask, cache, 1))
    return tokens, mask, logits, cache


@torch.no_grad()
def call(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, cache: Any, new: int) -> torch.Tensor:
    """The logits of each of the last ``new`` tokens, fed in one call."""
    out = model(input_ids=tokens[:, -new:], attention_mask=mask, position_ids=positions(mask)[:, -new:],
                past_key_values=cache, use_cache=True)
    return out.logits  # type: ignore[no-any-return]


def test_crop_zero_after_the_window_was_outgrown_is_a_no_op() -> None:
    model = streaming()
    ids, mask = prompts()  # 6-token prompts, a 1 + 3 token window: evicted at the prefill already
    tokens, full_mask, logits, cache = decode(model, ids, mask, 2)
    untouched = copy.deepcopy(cache)
    for _ in range(3):
        tokens, full_mask = extend(tokens, full_mask, logits[-1].argmax(-1, keepdim=True))
        cache.crop(0)
        got = step(model, tokens, full_mask, cache, 1)
        want = step(model, tokens, full_mask, untouched, 1)
        assert torch.equal(got, want)
        logits.append(got)


def test_a_crop_within_what_the_windows_hold_continues_as_the_rule_says() -> None:
    model = streaming()
    ids, mask = prompts()
    tokens, full_mask, logits, cache = decode(model, ids, mask, 2)  # every row outgrew its window
    g = torch.Generator().manual_seed(7)
    # a call of three tokens (a verifier's candidates), of which two are taken back and replaced
    tokens, full_mask = extend(tokens, full_mask, torch.randint(1, 97, (3, 3), generator=g))
    call(model, tokens, full_mask, cache, 3)
    cache.crop(-2)
    tokens, full_mask = tokens[:, :-2], full_mask[:, :-2]
    tokens, full_mask = extend(tokens, full_mask, torch.randint(1, 97, (3, 2), generator=g))
    got = call(model, tokens, full_mask, cache, 2)  # (B, 2, V)
    # a single decode step, then one token taken back
    tokens, full_mask = extend(tokens, full_mask, got[:, -1].argmax(-1, keepdim=True))
    call(model, tokens, full_mask, cache, 1)
    cache.crop(-1)
    last = call(model, tokens, full_mask, cache, 1)
    plans = condcomp.request_plans(model, cache)
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == {"full", "window"}
    ref = rule_logits(model, plans, tokens, full_mask, SINKS, WINDOW)
    torch.testing.assert_close(got.double(), ref[:, -3:-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last.double(), ref[:, -1:], atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == tokens.shape[1]


def test_a_crop_into_evicted_tokens_is_refused_before_anything_changes() -> None:
    model = streaming()
    ids, mask = prompts()
    tokens, full_mask, logits, cache = decode(model, ids, mask, 2)
    before = cache_bytes(cache)
    with pytest.raises(ValueError, match=r"row\(s\) \[0, 1\].*evicted.*crop the whole cache"):
        cache.crop(-2)  # row 2 (2 real tokens + 2) still holds every token; rows 0 and 1 evicted one
    assert cache.get_seq_length() == tokens.shape[1] and cache_bytes(cache) == before
    step(model, tokens, full_mask, cache, 1)  # the request continues


def test_cropping_the_whole_cache_starts_a_new_request() -> None:
    model = streaming()
    ids, mask = prompts()
    _, _, _, cache = decode(model, ids, mask, 3)
    cache.crop(-cache.get_seq_length())
    assert cache.get_seq_length() == 0 and condcomp.request_plans(model, cache) == {}
    other, other_mask = prompts(seed=11)
    tokens, full_mask, logits, cache = decode(model, other, other_mask, 2, cache)
    plans = condcomp.request_plans(model, cache)
    ref = rule_logits(model, plans, tokens, full_mask, SINKS, WINDOW)
    for i, got in enumerate(logits):
        torch.testing.assert_close(got.double(), ref[:, other.shape[1] - 1 + i], atol=1e-4, rtol=1e-4)


def assistant_of(tokens: int) -> nn.Module:
    """Another (unwrapped) random model drafting ``tokens`` candidates every round: most are rejected."""
    assistant = llama(4, seed=1)
    assistant.generation_config.num_assistant_tokens = tokens
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # draft every candidate, however unsure
    return assistant


def test_assisted_decoding_with_streamed_groups_equals_the_greedy_decode_without_an_assistant(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = streaming(window=6)  # 1 + 6 entries: the 3-token prompt and 3 candidates fit the first call
    crops: list[tuple[int, int]] = []
    crop = t.DynamicCache.crop

    def spy(self: Any, n: int) -> None:
        if any(getattr(layer, "condcomp_plan", None) is not None for layer in self.layers):  # the wrapped model's
            crops.append((n, self.get_seq_length()))
        crop(self, n)

    monkeypatch.setattr(t.DynamicCache, "crop", spy)
    ids = torch.randint(1, 97, (1, 3), generator=torch.Generator().manual_seed(2))
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              do_sample=False, pad_token_id=0)
    with condcomp.plan_from_prompt(model, ids.shape[1]):  # the plan from the prompt, not from the candidates
        want = model.generate(**kw)
        got = model.generate(**kw, assistant_model=assistant_of(3))
    assert torch.equal(got, want)
    assert any(n <= -2 and length > 1 + 6 + 3 for n, length in crops)  # rejected candidates after the eviction


def _greedy_under_the_rule(model: nn.Module, tokens: torch.Tensor, prompt_len: int) -> None:
    """Every token after the prompt is the argmax of the float64 rule's logits before it (plans from the prompt)."""
    cache = t.DynamicCache()
    ones = torch.ones_like(tokens)
    with condcomp.plan_from_prompt(model, prompt_len):
        step(model, tokens[:, :prompt_len], ones[:, :prompt_len], cache, prompt_len)
    ref = rule_logits(model, condcomp.request_plans(model, cache), tokens, ones, SINKS, WINDOW)  # (1, S, V)
    top2 = ref[0, prompt_len - 1:-1].topk(2, -1).values  # (new, 2)
    assert bool((top2[:, 0] - top2[:, 1] > 1e-4).all())  # no near-tie the float32 path could flip
    assert torch.equal(ref[0, prompt_len - 1:-1].argmax(-1), tokens[0, prompt_len:])


def test_a_first_call_longer_than_the_window_keeps_its_candidates_until_they_are_verified(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Assisted decoding's first call is the prompt and the first candidates, already past the window (6 + 3
    tokens, 1 + 3 entries): under plan_from_prompt the tokens after the prompt stay in the windows until the next
    call, so rejecting them works, and the tokens are plain greedy decoding's and the float64 rule's."""
    model = streaming()
    crops: list[tuple[int, int]] = []
    crop = t.DynamicCache.crop

    def spy(self: Any, n: int) -> None:
        if any(getattr(layer, "condcomp_plan", None) is not None for layer in self.layers):
            crops.append((n, self.get_seq_length()))
        crop(self, n)

    monkeypatch.setattr(t.DynamicCache, "crop", spy)
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False, pad_token_id=0)
    with condcomp.plan_from_prompt(model, ids.shape[1]):
        want = model.generate(**kw)
        got = model.generate(**kw, assistant_model=assistant_of(3))
    assert crops[0] == (-3, 6 + 3)  # the first round rejected all three candidates, fed with the 6-token prompt
    assert torch.equal(got, want)
    _greedy_under_the_rule(model, got, ids.shape[1])


def test_prompt_lookup_on_topk_stream_window_rejects_its_first_candidates_as_plain_greedy_decoding() -> None:
    model = llama(4)
    router = ("topk", {"kv_groups": True, "stream_window": WINDOW, "stream_sinks": SINKS})
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=router))
    model.eval()
    ids = torch.tensor([[5, 6, 7, 8, 9] * 2 + [5, 6]])  # the lookup drafts 7 8 9 5: the random model rejects them
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              do_sample=False, pad_token_id=0)
    with condcomp.plan_from_prompt(model, ids.shape[1]):
        want = model.generate(**kw)
        got = model.generate(**kw, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)
    _greedy_under_the_rule(model, got, ids.shape[1])


def test_a_prefill_keeps_only_the_tokens_after_the_prompt_beyond_its_window() -> None:
    model = streaming()
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    for prompt_len, extra in ((9, 0), (6, 3), (2, 7)):
        cache = t.DynamicCache()
        with condcomp.plan_from_prompt(model, prompt_len):
            step(model, ids, torch.ones_like(ids), cache, 9)
        held = [layer.condcomp_windows.positions for layer in cache.layers]
        want = sorted({*range(SINKS), *range(max(9 - WINDOW - extra, 0), 9)})  # sinks, window, tokens after the prompt
        assert all(p.tolist() == [want] * 2 for p in held), (prompt_len, held)


def test_a_row_whose_prompt_is_only_padding_is_refused_even_with_tokens_after_it() -> None:
    """Red team round 5: under plan_from_prompt a first call carrying tokens after the prompt let a row whose
    prompt was all padding through, its plan decided from no token (an empty prompt alone is refused)."""
    model = streaming()
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # row 1: six padding columns of prompt, then three real tokens
    with condcomp.plan_from_prompt(model, 6), pytest.raises(ValueError, match=r"row\(s\) \[1\] hold no real"):
        step(model, ids, mask, t.DynamicCache(), 9)
    mask[1, 5] = 1  # one real prompt token: accepted
    with condcomp.plan_from_prompt(model, 6):
        step(model, ids, mask, t.DynamicCache(), 9)


def test_without_plan_from_prompt_a_first_call_past_the_window_cannot_take_back_its_candidates() -> None:
    """Without plan_from_prompt nothing says which tokens of the first call are candidates (and the plan is
    decided from them too): the prefill keeps only the window, and taking candidates back is refused, naming
    the fix."""
    model = streaming()
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="evicted.*plan_from_prompt"):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                       pad_token_id=0, assistant_model=assistant_of(3))


def _dense_layer_bytes(B: int, groups: int, S: int, Dh: int) -> int:
    return 4 * 2 * B * groups * S * Dh  # float32 keys and values


def test_cache_bytes_counts_the_storage_a_crop_keeps_held() -> None:
    cache = t.DynamicCache()
    cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    assert cache_bytes(cache) == [2 * 2 * 5 * 4 * 4]  # the 5-token storage stays held until the next update
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    assert cache_bytes(cache) == [2 * 2 * 4 * 4 * 4]  # the update copied 4 tokens into a new storage

    ids, mask = prompts()
    B, Dh = ids.shape[0], 8
    tokens, _, _, dense = decode(llama(4), ids, mask, 1)
    S = tokens.shape[1]
    dense.crop(-3)
    assert cache_bytes(dense) == [_dense_layer_bytes(B, 4, S, Dh)] * 2

    model = streaming()
    tokens, _, _, cache = decode(model, ids, mask, 1)
    want = []
    for plan in condcomp.request_plans(model, cache).values():  # by hand, as held before the crop
        assert plan.kv_modes is not None
        g = int((plan.kv_modes == KV_FULL).sum(-1).max())
        gw = int((plan.kv_modes == KV_WINDOW).sum(-1).max())
        n = SINKS + WINDOW  # every row's window is full (S = 7 > 4)
        want.append(_dense_layer_bytes(B, max(g, 1), S, Dh if g else 1) + 4 * 2 * B * gw * n * Dh + 8 * (B * n + B))
    assert cache_bytes(cache) == want
    cache.crop(-1)  # within the windows: the full groups' views shrink, their storage does not
    assert cache.get_seq_length() == S - 1
    assert cache_bytes(cache) == want
