"""GPT-2, BERT as a decoder and T5's decoder self-attention on the compact per-request KV cache, under KV policies.

Every family runs the base decoder sequence (integrations/hf/decode.py). Oracles (family_oracles): ``drop`` and
``full`` against the unwrapped model with each row's dropped heads' outputs zeroed (``full``: the groups a plan
does not keep at gate 1); ``window`` against the streaming rule written from scratch in float64. ``cache_bytes``
against a hand count of the tensors held; batches whose rows keep different heads; beams (reorder) and crop.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from condcomp.integrations.hf.cache import cache_bytes
from decode_helpers import GREEDY, TOL, P, extend, positions, prompts
from family_oracles import T5_DECODER_SELF, bert, gated_unwrapped, gpt2, new_cache, t5, window_rule_logits
from torch import Tensor, nn

import condcomp
from condcomp.kv.selection import KV_FULL, KV_WINDOW

t = pytest.importorskip("transformers")

NEW, SINKS, WINDOW, D, H = 4, 1, 3, 64, 4
ENCODER_TOKENS = 5  # T5's encoder input length
BUILD = {"gpt2": gpt2, "bert": bert, "t5": lambda: t5(seed=1)}  # T5 seed 1: its rows' plans differ in each layer


def wrapped(family: str, kv: Any = "drop", fraction: float = 0.5) -> nn.Module:
    model = BUILD[family]()
    target = [T5_DECODER_SELF] if family == "t5" else None
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}), router="topk", kv=kv,
                                                   target_modules=target))
    return model.eval()


def encoder_inputs(batch: int = 3) -> dict[str, Tensor]:
    """T5's encoder input, right-padded; its decoder prompt is :func:`prompts`' ids without padding."""
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(batch, ENCODER_TOKENS, dtype=torch.long)
    mask[1, 3:] = 0
    return {"input_ids": torch.randint(1, 97, (batch, ENCODER_TOKENS), generator=g), "attention_mask": mask}


@torch.no_grad()
def forward(model: nn.Module, family: str, tokens: Tensor, mask: Tensor, cache: Any, new: int) -> Tensor:
    """Logits ``(B, new, V)`` of the last ``new`` tokens (``mask`` covers every token so far) on ``cache``."""
    kw: dict[str, Any] = {"use_cache": cache is not None, "cache": cache}
    if family == "t5":
        out = model(**encoder_inputs(tokens.shape[0]), decoder_input_ids=tokens[:, -new:], **kw)
    else:
        out = model(input_ids=tokens[:, -new:], attention_mask=mask, position_ids=positions(mask)[:, -new:], **kw)
    return out.logits[:, -new:]  # type: ignore[no-any-return]


def prompt(family: str) -> tuple[Tensor, Tensor]:
    ids, mask = prompts()
    if family == "t5":  # T5's decoder prompt: no padding, starting with the decoder start token (as generate's)
        return torch.cat([torch.zeros_like(ids[:, :1]), ids[:, 1:]], 1), torch.ones_like(mask)
    return ids, mask


def decode(model: nn.Module, family: str, steps: int = NEW) -> tuple[Tensor, Tensor, list[Tensor], Any]:
    """Greedy decoding by hand: the prefill, then ``steps`` one-token calls; each call's last logits."""
    ids, mask = prompt(family)
    cache = new_cache(family)
    logits = [forward(model, family, ids, mask, cache, P)[:, -1]]
    tokens = ids
    for _ in range(steps):
        tokens, mask = extend(tokens, mask, logits[-1].argmax(-1, keepdim=True))
        logits.append(forward(model, family, tokens, mask, cache, 1)[:, -1])
    return tokens, mask, logits, cache


def rows_differ(plans: dict[str, Any]) -> bool:
    """Whether some layer's rows hold different key/value groups in different modes (a row mix-up would show)."""
    return any(len({tuple(row) for row in p.group_modes()}) > 1 for p in plans.values())


def hand_count(plans: dict[str, Any], B: int, S: int, window: bool = False, family: str = "") -> list[int]:
    """Bytes by hand: float32 keys and values of the batch's most kept groups at every token; a window policy's
    groups also hold ``SINKS + WINDOW`` tokens each, with an int64 position per token and a length per row. T5's
    layers also hold the cross-attention keys and values of every head at each of the 5 encoder tokens."""
    Dh, want = D // H, []
    cross = 4 * 2 * B * H * ENCODER_TOKENS * Dh if family == "t5" else 0
    for plan in plans.values():
        assert plan.kv_modes is not None
        g = int((plan.kv_modes == KV_FULL).sum(-1).max())
        gw = int((plan.kv_modes == KV_WINDOW).sum(-1).max())
        n = min(S, SINKS + WINDOW)
        held = 4 * 2 * B * max(g, 1) * S * (Dh if g else 1)
        want.append(held + cross + (4 * 2 * B * gw * n * Dh + 8 * (B * n + B) if window and gw else 0))
    return want


@pytest.mark.parametrize("family,kv", [("gpt2", "drop"), ("gpt2", "full"), ("bert", "drop"), ("bert", "full"),
                                       ("t5", "drop"), ("t5", "full")])
def test_decoding_equals_the_unwrapped_model_with_each_rows_dropped_heads_zeroed(family: str, kv: str) -> None:
    model = wrapped(family, kv)
    tokens, mask, logits, cache = decode(model, family)
    plans = condcomp.request_plans(model, cache)
    assert len(plans) == 2 and (rows_differ(plans) or kv == "full")  # full: MHA holds every group of every row
    ref = gated_unwrapped(model, family, plans, full_groups=kv == "full")
    want = forward(ref, family, tokens, mask, None, tokens.shape[1])  # one cache-free forward
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, P - 1 + i], **TOL, msg=f"{family} step {i}")
    B, S = tokens.shape
    layers = cache_bytes(cache)
    assert layers == hand_count(plans, B, S, family=family)
    Dh = D // H
    cross = 4 * 2 * B * H * ENCODER_TOKENS * Dh if family == "t5" else 0  # T5: every head's encoder keys, values
    if kv == "drop":  # 2 of 4 heads kept: half the dense self-attention cache
        assert layers == [4 * 2 * B * 2 * S * Dh + cross] * 2
    else:  # full: every group held
        assert layers == [4 * 2 * B * H * S * Dh + cross] * 2


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_window_policy_equals_the_streaming_rule_in_float64(family: str) -> None:
    model = wrapped(family, ("window", {"sinks": SINKS, "window": WINDOW}))
    tokens, mask, logits, cache = decode(model, family)
    plans = condcomp.request_plans(model, cache)
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == {"full", "window"}
    assert rows_differ(plans)
    want = window_rule_logits(model, family, plans, tokens, mask, SINKS, WINDOW)
    for i, got in enumerate(logits):
        torch.testing.assert_close(got.double(), want[:, P - 1 + i], **TOL, msg=f"{family} step {i}")
    assert cache_bytes(cache) == hand_count(plans, *tokens.shape, window=True, family=family)


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_beam_search_equals_the_unwrapped_models_beam_search_with_the_same_heads_zeroed(family: str) -> None:
    model = wrapped(family)
    ids, mask = prompt(family)
    beams = 3
    # the plans generate decides: each prompt row repeated for its beams decides the same plan
    _, _, _, cache = decode(model, family, steps=0)
    plans = condcomp.request_plans(model, cache)
    ref = gated_unwrapped(model, family, plans)
    kw: dict[str, Any] = dict(max_new_tokens=NEW, num_beams=beams, output_logits=True, return_dict_in_generate=True,
                              no_repeat_ngram_size=1, **GREEDY)  # no repeats: tiny models' ties hide nothing
    if family == "t5":
        kw.update(encoder_inputs(), decoder_input_ids=ids)
    else:
        kw.update(input_ids=ids, attention_mask=mask)
    got, want = model.generate(**kw), ref.generate(**kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), **TOL)
    self_cache = getattr(got.past_key_values, "self_attention_cache", got.past_key_values)
    assert all(layer.keys.shape[1] == 2 for layer in self_cache.layers)  # the compact cache: 2 of 4 heads


@pytest.mark.parametrize("family,kv", [("gpt2", "drop"), ("gpt2", ("window", {"sinks": SINKS, "window": 12})),
                                       ("t5", "drop")])
def test_crop_then_feeding_the_token_again_gives_the_same_logits(family: str, kv: Any) -> None:
    model = wrapped(family, kv)  # a window of 12: nothing evicted within the test's tokens, so crop may go back
    tokens, mask, logits, cache = decode(model, family, steps=2)
    cache.crop(-1)  # forget the last fed token, then feed it again
    assert cache.get_seq_length() == tokens.shape[1] - 1
    got = forward(model, family, tokens, mask, cache, 1)[:, -1]
    torch.testing.assert_close(got, logits[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_snapkv_with_a_budget_covering_the_prompt_keeps_every_token_and_equals_full_groups(family: str) -> None:
    """A policy with a state of its own besides ``window``: ``snapkv`` whose budget covers the whole prompt keeps
    every token of the groups a plan does not keep, so they attend like groups held in full (gate 1)."""
    model = wrapped(family, ("snapkv", {"budget": P, "observe": 2, "pool": 1}))
    tokens, mask, logits, cache = decode(model, family)
    plans = condcomp.request_plans(model, cache)
    assert rows_differ(plans) and {m for p in plans.values() for row in p.group_modes() for m in row} == {
        "full", "snapkv"}
    ref = gated_unwrapped(model, family, plans, full_groups=True)
    want = forward(ref, family, tokens, mask, None, tokens.shape[1])
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, P - 1 + i], **TOL, msg=f"{family} step {i}")
