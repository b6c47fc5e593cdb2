"""Token-selecting KV policies' numbers at their bounds, and ``crop`` with transformers' two forms (red team round 5).

Before the one option check, ``adakv`` took ``budget=2**62`` (its layer budget ``budget x groups`` wrapped in int64:
it kept almost nothing) and ``snapkv`` took ``budget=10**30`` (an ``OverflowError`` at the first prefill); a positive
``cache.crop(11)`` on a snapkv cache was read as a count of 11 and refused as a crop into the prompt.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import condcomp
from condcomp.kv.adakv import AdaKV
from condcomp.kv.snapkv import SnapKV
from condcomp.options import MAX_COUNT

BOUND = r"<= 1099511627776 \(2\*\*40\)"


def _llama(t: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=50)
    return t.LlamaForCausalLM(config).eval()


def _wrapped(t: Any, kv: Any) -> torch.nn.Module:
    model = _llama(t)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}), kv=kv))
    return model


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("name, cls", [("snapkv", SnapKV), ("adakv", AdaKV)])
@pytest.mark.parametrize("budget", [2**62, 10**30, MAX_COUNT + 1])
def test_a_budget_beyond_the_bound_is_refused_naming_the_option_the_policy_and_the_bound(name: str, cls: Any,
                                                                                        budget: int) -> None:
    with pytest.raises(ValueError, match=rf"{name} kv policy: budget .* {BOUND}.*, got {budget}"):
        condcomp.CondCompConfig(kv=(name, {"budget": budget}))
    with pytest.raises(ValueError, match=rf"{name} kv policy: budget .* {BOUND}"):
        cls(budget=budget)


@pytest.mark.parametrize("kv", [("snapkv", {"budget": MAX_COUNT, "observe": 2, "pool": 3}),
                                ("adakv", {"budget": MAX_COUNT, "floor": 0.0, "observe": 2, "pool": 3})])
def test_the_largest_budget_keeps_every_token_and_decodes_as_the_unwrapped_model(kv: Any) -> None:
    # adakv's layer budget is budget x held groups: at the bound it stays inside int64, so every prompt token is kept
    t = pytest.importorskip("transformers")
    ids, mask = _prompt()
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    got = _wrapped(t, kv).generate(input_ids=ids, attention_mask=mask, **kwargs)
    want = _llama(t).generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", ["snapkv", "adakv", "window"])
def test_a_positive_crop_is_an_absolute_length_as_in_transformers_legacy_form(kv: str) -> None:
    # crop(11) on a cache of 9 prompt + 3 generated tokens keeps 11 tokens: the next step equals the unwrapped model's
    # on a plain cache cropped by the count crop(-1); a length at or above what it holds changes nothing
    t = pytest.importorskip("transformers")
    options = {"window": {"sinks": 2, "window": 64}}.get(kv, {"budget": 64, "observe": 2, "pool": 3})
    ids, mask = _prompt()
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    model, dense = _wrapped(t, (kv, options)), _llama(t)
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    ref = dense.generate(input_ids=ids, attention_mask=mask, **kwargs)
    cache, plain = out.past_key_values, ref.past_key_values
    assert cache.get_seq_length() == plain.get_seq_length() == 11  # the last token is not cached yet
    same = copy.deepcopy(cache)
    same.crop(11)
    same.crop(40)
    assert same.get_seq_length() == 11
    cache.crop(10)
    plain.crop(-1)
    assert cache.get_seq_length() == plain.get_seq_length() == 10
    seq = out.sequences[:, :11]
    full_mask = torch.cat([mask, torch.ones(2, 2, dtype=mask.dtype)], 1)
    step = dict(input_ids=seq[:, 10:], attention_mask=full_mask, use_cache=True)
    torch.testing.assert_close(model(past_key_values=cache, **step).logits,
                               dense(past_key_values=plain, **step).logits, atol=1e-4, rtol=1e-4)
