"""Cache classes and decoding modes with per-request plans: crop, prompt-lookup decoding, beam search, sliding-window
and quantized caches, T5's EncoderDecoderCache, per-call budgets and reading each request's plan.

References: the unwrapped model at the full budget; otherwise the reference executor without a cache, plans
decided from the prompt (decode_helpers).
"""

from __future__ import annotations

import copy

import pytest
import torch
from decode_helpers import (
    GREEDY,
    TOL,
    P,
    extend,
    llama,
    positions,
    prompts,
    reference_greedy,
    reference_logits,
    rows_differ,
    step,
    t,
    wrap,
)
from torch import nn

import condcomp


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_crop_keeps_the_plan_and_redecoding_equals_the_reference(static: bool) -> None:
    model = wrap(llama(kv_heads=4))
    ids, mask = prompts()
    cache = t.StaticCache(config=model.config, max_cache_len=16) if static else t.DynamicCache()
    tokens, grown = ids, mask
    nxt = step(model, tokens, grown, cache, P).argmax(-1, keepdim=True)
    for _ in range(3):
        tokens, grown = extend(tokens, grown, nxt)
        nxt = step(model, tokens, grown, cache, 1).argmax(-1, keepdim=True)
    cache.crop(-2)  # back to prompt + 1 token: decode the second generated token again
    got = step(model, tokens[:, :-1], grown[:, :-1], cache, 1)
    torch.testing.assert_close(got, reference_logits(model, tokens, mask)[:, -2], **TOL)
    cache.crop(-int(cache.get_seq_length()))  # emptied: the next call is a new request with its own plan
    assert condcomp.request_plans(model, cache) == {}
    nxt = step(model, ids, mask, cache, P)
    torch.testing.assert_close(nxt, reference_logits(model, ids, mask)[:, -1], **TOL)


@pytest.mark.slow
def test_prompt_lookup_decoding_equals_greedy_reference_decoding() -> None:
    model = wrap(llama(kv_heads=4))
    ids, _ = prompts(batch=1)
    ids = torch.cat([ids, ids[:, :3], ids[:, 1:4]], 1)  # repeats for the lookup to draft from
    got = model.generate(input_ids=ids, max_new_tokens=6, prompt_lookup_num_tokens=2, **GREEDY)
    assert torch.equal(got, reference_greedy(model, ids, torch.ones_like(ids), 6))


def test_beam_search_with_rows_of_different_plans_equals_beam_search_on_reference_scores() -> None:
    """Beam search reorders the cache every step; each beam must keep its own request's plan."""
    model = wrap(llama(kv_heads=4))
    ids, mask = prompts()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2, length_penalty=0.0,
                         output_scores=True, return_dict_in_generate=True, **GREEDY)
    assert rows_differ(model, out.past_key_values)
    # each returned beam scores as the reference scores its tokens (summed log-probabilities, no length penalty)
    seqs = out.sequences
    logp = reference_logits(model, seqs, mask).log_softmax(-1)[:, P - 1:-1]
    want = logp.gather(-1, seqs[:, P:].unsqueeze(-1)).squeeze(-1).sum(-1)  # (B,)
    torch.testing.assert_close(out.sequences_scores, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_sliding_window_caches_at_the_full_and_half_budget(static: bool) -> None:
    torch.manual_seed(0)
    config = t.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=97, sliding_window=4, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    dense = t.MistralForCausalLM(config).eval()
    ids, mask = prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
    if static:
        kw["cache_implementation"] = "static"
    full = wrap(copy.deepcopy(dense), policy="full")
    assert torch.equal(full.generate(**kw), dense.generate(**kw))
    half = wrap(copy.deepcopy(dense), 0.5)
    assert torch.equal(half.generate(**kw), reference_greedy(half, ids, mask, 5))


def test_quantized_fp8_cache_at_the_full_budget_equals_the_unwrapped_model_and_keeps_groups_at_half() -> None:
    dense = llama(kv_heads=4)
    ids, mask = prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, cache_implementation="quantized",
              cache_config={"backend": "fp8"}, **GREEDY)
    full = wrap(copy.deepcopy(dense), policy="full")
    assert torch.equal(full.generate(**kw), dense.generate(**kw))
    half = wrap(copy.deepcopy(dense), 0.5)
    out = half.generate(**kw, return_dict_in_generate=True)
    plans = condcomp.request_plans(half, out.past_key_values)
    assert plans and all(p.compact and p.kv_groups.sum(-1).max() == 2 for p in plans.values())


def _t5() -> nn.Module:
    torch.manual_seed(0)
    return t.T5ForConditionalGeneration(t.T5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                                   vocab_size=97, decoder_start_token_id=0,
                                                   attn_implementation="sdpa")).eval()


@pytest.mark.slow
def test_t5_encoder_decoder_cache_greedy_and_beams() -> None:
    dense = _t5()
    ids, mask = prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    full = wrap(copy.deepcopy(dense), policy="full")
    assert torch.equal(full.generate(**kw), dense.generate(**kw))
    assert torch.equal(full.generate(**kw, num_beams=2), dense.generate(**kw, num_beams=2))
    half = wrap(copy.deepcopy(dense), 0.5)
    got = half.generate(**kw, return_dict_in_generate=True)
    plans = condcomp.request_plans(half, got.past_key_values)
    assert any(".EncDecAttention" in n for n in plans) and not any(n.startswith("encoder") for n in plans)
    # reference: cache-free forwards, the encoder's plan from the whole input, the decoder's from its first token
    ref = copy.deepcopy(half)
    for name, m in condcomp.api.routed_modules(ref).items():
        m.executor = "reference"
        m.prompt_len = 1 if name.startswith("decoder") else None
    dec = torch.zeros(3, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(4):
            logits = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, use_cache=False).logits
            dec = torch.cat([dec, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got.sequences, dec)


def test_a_per_call_budget_equals_a_model_wrapped_at_that_budget_and_the_plan_is_readable() -> None:
    model = wrap(llama(kv_heads=4), 0.5)
    at_quarter = wrap(llama(kv_heads=4), 0.25)  # same seed: the same router weights, another fixed budget
    ids, mask = prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    cache = t.DynamicCache()
    with condcomp.budget(model, 0.25):
        got = model.generate(**kw, past_key_values=cache)
    assert torch.equal(got, at_quarter.generate(**kw))
    assert not torch.equal(model.generate(**kw), got)  # outside the block: the wrap's own budget again
    plans = condcomp.request_plans(model, cache)
    assert set(plans) == set(condcomp.api.routed_modules(model))
    for plan in plans.values():
        assert all(len(groups) == 1 for groups in plan.kept_kv_groups())  # 2 of 8 heads = 1 of 4 groups
    # the kept groups are what the cache holds: layer 0's cached keys are the dense model's keys of those groups
    dense_cache = t.DynamicCache()
    with torch.no_grad(), condcomp.disabled(model):
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), past_key_values=dense_cache,
              use_cache=True)
    groups = plans["model.layers.0.self_attn"].kept_kv_groups()
    for b in range(3):
        real = mask[b].bool()
        ours, dense = cache.layers[0].keys[b, :1, :P], dense_cache.layers[0].keys[b, groups[b]]
        torch.testing.assert_close(ours[:, real], dense[:, real], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="fraction"):
        with condcomp.budget(model, 1.5):
            pass


def test_batch_repeat_interleave_repeats_each_rows_plan() -> None:
    model = wrap(llama(kv_heads=4))
    ids, mask = prompts()
    cache = t.DynamicCache()
    nxt = step(model, ids, mask, cache, P).argmax(-1, keepdim=True)
    cache.batch_repeat_interleave(2)
    rows = torch.arange(3).repeat_interleave(2)
    tokens, grown = extend(ids[rows], mask[rows], nxt[rows])
    got = step(model, tokens, grown, cache, 1)
    torch.testing.assert_close(got, reference_logits(model, tokens, mask[rows])[:, -1], **TOL)
    with pytest.raises(ValueError, match="batch_repeat_interleave"):  # rows the cache does not hold: named
        step(model, tokens[:4], grown[:4], cache, 1)


def test_continuous_batching_is_refused_with_the_reason() -> None:
    """generate_batch packs every request into one row of a PagedAttentionCache: no row for a request's plan."""
    model = wrap(llama(kv_heads=4))
    ids, _ = prompts(batch=1)
    config = t.GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)
    small = t.ContinuousBatchingConfig(num_blocks=8, block_size=16, max_batch_tokens=32)
    out = model.generate_batch(inputs=[ids[0].tolist()], generation_config=config, continuous_batching_config=small,
                               warmup=False)
    (result,) = out.values()
    assert result.generated_tokens == [] and "continuous batching" in str(result.error)


@pytest.mark.parametrize("cache", ["dynamic", "quantized"])
def test_a_layer_whose_plan_keeps_no_head_still_counts_the_requests_tokens(cache: str) -> None:
    """k = 0 in every row of layer 0 (k_min = 0): its cache layer must still hold the request's tokens, since
    generate() reads the positions of every layer from layer 0's length; layer 1 keeps half its heads."""
    model = llama(kv_heads=4)
    router = ("topk", {"kv_groups": True})
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.0, "k_min": 0}), router=router,
                                                   target_modules=["model.layers.0.self_attn"]))
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=router,
                                                   target_modules=["model.layers.1.self_attn"]))
    ids, mask = prompts()
    extra = {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}} if cache == "quantized" else {}
    out = model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True,
                                **extra, **GREEDY)
    assert out.past_key_values.get_seq_length() == P + 3
    plans = condcomp.request_plans(model, out.past_key_values)
    assert plans["model.layers.0.self_attn"].kept_heads() == [[], [], []]
    if cache == "dynamic":  # fp8 rounds the kept keys; the reference does not
        assert torch.equal(out.sequences, reference_greedy(model, ids, mask, 4))
