"""A request's plan travels with its KV cache: transformers' cache operations, cache classes and mode switches.

Every test compares with an independent reference (decode_helpers): the reference executor without a cache and
with the plan decided from the prompt, or, at the full budget, the unwrapped model.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from decode_helpers import (
    GREEDY,
    TOL,
    extend,
    gpt2,
    llama,
    prompts,
    reference_greedy,
    reference_logits,
    rows_differ,
    step,
    t,
    wrap,
)

import condcomp


def _prefill(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: object) -> torch.Tensor:
    return step(model, ids, mask, cache, ids.shape[1]).argmax(-1, keepdim=True)


@pytest.mark.parametrize("build", [llama, gpt2])
def test_a_reset_cache_reused_for_a_new_larger_batch_decides_new_plans(build: object) -> None:
    model = wrap(build())  # type: ignore[operator]
    cache = t.DynamicCache()
    first, first_mask = prompts(batch=1, seed=9)
    _prefill(model, first, first_mask, cache)
    cache.reset()
    ids, mask = prompts()
    nxt = _prefill(model, ids, mask, cache)
    tokens, mask2 = extend(ids, mask, nxt)
    got = step(model, tokens, mask2, cache, 1)
    want = reference_logits(model, tokens, mask)
    torch.testing.assert_close(got, want[:, -1], **TOL)
    assert rows_differ(model, cache)


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_at_the_full_budget_generates_the_unwrapped_models_tokens(padded: bool) -> None:
    dense = llama()
    wrapped = wrap(copy.deepcopy(dense), policy="full")
    ids, mask = prompts() if padded else (prompts()[0][:1], None)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, cache_implementation="static", **GREEDY)
    out_dense = dense.generate(**kw, output_logits=True, return_dict_in_generate=True)
    out = wrapped.generate(**kw, output_logits=True, return_dict_in_generate=True)
    torch.testing.assert_close(out.logits[0], out_dense.logits[0], **TOL)  # the prefill's logits
    assert torch.equal(out.sequences, out_dense.sequences)


@pytest.mark.slow
@pytest.mark.parametrize("arch, fraction", [("llama", 0.5), ("llama", 0.25), ("gpt2", 0.5)])
def test_static_cache_with_a_left_padded_batch_matches_the_reference(arch: str, fraction: float) -> None:
    model = wrap(llama(kv_heads=4) if arch == "llama" else gpt2(), fraction)
    ids, mask = prompts()
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, cache_implementation="static",
                         **GREEDY)
    assert torch.equal(got, reference_greedy(model, ids, mask, 4))


def test_reorder_cache_reorders_each_rows_plan() -> None:
    model = wrap(llama(kv_heads=4), 0.5)
    ids, mask = prompts()
    cache = t.DynamicCache()
    nxt = _prefill(model, ids, mask, cache)
    assert rows_differ(model, cache)
    order = torch.tensor([2, 0, 1])
    cache.reorder_cache(order)
    tokens, mask2 = extend(ids[order], mask[order], nxt[order])
    got = step(model, tokens, mask2, cache, 1)
    torch.testing.assert_close(got, reference_logits(model, tokens, mask[order])[:, -1], **TOL)


def test_batch_select_indices_keeps_the_selected_rows_plans() -> None:
    model = wrap(llama(kv_heads=4), 0.5)
    ids, mask = prompts()
    cache = t.DynamicCache()
    nxt = _prefill(model, ids, mask, cache)
    tokens, mask2 = extend(ids, mask, nxt)
    nxt = step(model, tokens, mask2, cache, 1).argmax(-1, keepdim=True)
    keep = torch.tensor([0, 2])  # the middle request finished
    cache.batch_select_indices(keep)
    tokens, mask3 = extend(tokens[keep], mask2[keep], nxt[keep])
    got = step(model, tokens, mask3, cache, 1)
    torch.testing.assert_close(got, reference_logits(model, tokens, mask[keep])[:, -1], **TOL)


@pytest.mark.slow
def test_generate_without_a_cache_is_refused_and_equals_cached_generation_with_plans_from_the_prompt() -> None:
    model = wrap(llama())
    ids, mask = prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    with pytest.raises(ValueError, match="plan_from_prompt"):
        model.generate(**kw, use_cache=False)
    with condcomp.plan_from_prompt(model, ids.shape[1]):
        cache_free = model.generate(**kw, use_cache=False)
    assert torch.equal(cache_free, reference_greedy(model, ids, mask, 6))
    assert torch.equal(model.generate(**kw), cache_free)
    # a scoring forward without a cache (not inside generate) still decides its plan from its own input
    model(input_ids=ids, attention_mask=mask, use_cache=False)


def test_disabled_after_a_routed_prefill_is_refused_for_a_compact_cache_and_exact_at_the_full_budget() -> None:
    model = wrap(llama())
    ids, mask = prompts()
    cache = t.DynamicCache()
    nxt = _prefill(model, ids, mask, cache)
    tokens, mask2 = extend(ids, mask, nxt)
    with condcomp.disabled(model), pytest.raises(ValueError, match="condcomp.disabled"):
        step(model, tokens, mask2, cache, 1)
    dense = llama()
    full = wrap(copy.deepcopy(dense), policy="full")
    cache, dense_cache = t.DynamicCache(), t.DynamicCache()
    _prefill(full, ids, mask, cache)
    _prefill(dense, ids, mask, dense_cache)
    with condcomp.disabled(full):
        got = step(full, tokens, mask2, cache, 1)
    torch.testing.assert_close(got, step(dense, tokens, mask2, dense_cache, 1), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, gpt2])
def test_a_prefix_cache_continues_with_the_prefixs_plan(build: object) -> None:
    """transformers' prompt-reuse recipe: prefill a prefix once, then generate from copies of its cache."""
    model = wrap(build())  # type: ignore[operator]
    ids, _ = prompts(batch=1)
    prefix_len = 4
    prefix_cache = t.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :prefix_len], past_key_values=prefix_cache, use_cache=True)
    out = model.generate(input_ids=ids, past_key_values=copy.deepcopy(prefix_cache), max_new_tokens=4,
                         output_logits=True, return_dict_in_generate=True, **GREEDY)
    want = reference_greedy(model, ids, torch.ones_like(ids), 4, prompt_len=prefix_len)
    assert torch.equal(out.sequences, want)
    want_logits = reference_logits(model, want, torch.ones_like(ids), prefix_len)[:, ids.shape[1] - 1:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), want_logits, **TOL)
    assert prefix_cache.get_seq_length() == prefix_len  # the prefix itself is untouched


def test_pickled_model_and_cache_continue_mid_generation() -> None:
    model = wrap(llama(kv_heads=4), 0.5)
    ids, mask = prompts()
    cache = t.DynamicCache()
    nxt = _prefill(model, ids, mask, cache)
    tokens, mask2 = extend(ids, mask, nxt)
    model2, cache2 = pickle.loads(pickle.dumps((model, cache)))
    model3, cache3 = copy.deepcopy((model, cache))
    want = reference_logits(model, tokens, mask)[:, -1]
    for m, c in ((model2, cache2), (model3, cache3), (model, cache)):
        torch.testing.assert_close(step(m, tokens, mask2, c, 1), want, **TOL)


def test_a_mode_switch_mid_request_keeps_the_requests_plan() -> None:
    model = wrap(llama(kv_heads=4), 0.5)
    ids, mask = prompts()
    cache = t.DynamicCache()
    nxt = _prefill(model, ids, mask, cache)  # eval: the compact cache of the kept groups
    tokens, mask2 = extend(ids, mask, nxt)
    model.train()
    got = step(model, tokens, mask2, cache, 1)
    model.eval()
    torch.testing.assert_close(got, reference_logits(model, tokens, mask)[:, -1], **TOL)
    # prefill in train mode (every key/value head cached, the training plan stored), decode in eval: the same plan
    cache = t.DynamicCache()
    model.train()
    torch.manual_seed(5)
    _prefill(model, ids, mask, cache)
    held = condcomp.request_plans(model, cache)
    model.eval()
    step(model, tokens, mask2, cache, 1)
    after = condcomp.request_plans(model, cache)
    for name, plan in held.items():
        assert torch.equal(after[name].gates, plan.gates) and not plan.compact


@pytest.mark.slow
def test_a_per_token_budget_with_topk_generates_like_the_reference() -> None:
    model = wrap(llama(), policy=("budgetformer_token", {}))
    ids, mask = prompts()
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    assert torch.equal(got, reference_greedy(model, ids, mask, 4))


def test_a_cache_filled_by_the_dense_model_is_refused_by_its_data() -> None:
    model = wrap(llama())
    ids, mask = prompts()
    cache = t.DynamicCache()
    with condcomp.disabled(model):
        _prefill(model, ids, mask, cache)
    tokens, mask2 = extend(ids, mask, ids[:, :1])
    with pytest.raises(ValueError, match="no condcomp plan"):
        step(model, tokens, mask2, cache, 1)
    other = wrap(llama(kv_heads=4))  # a cache of another layout, with its plan
    cache = t.DynamicCache()
    _prefill(other, ids, mask, cache)
    with pytest.raises(ValueError, match="another model"):
        step(model, tokens, mask2, cache, 1)
    with pytest.raises(ValueError, match="filled by another model"):  # its plans are not this model's to read
        condcomp.request_plans(model, cache)


def test_a_scoring_forward_inside_another_models_generate_is_not_refused() -> None:
    """A wrapped decoder scoring the text (no cache) from a logits processor of another model's generate() is not
    that generate's cache-free generation: its plan is decided from its whole input, as outside generate()."""
    scorer, drafter = wrap(llama()), llama(seed=1)
    seen: list[torch.Tensor] = []

    class Score(t.LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                seen.append(scorer(input_ids=input_ids, use_cache=False).logits[:, -1])
            return scores

    ids, mask = prompts(batch=1)
    out = drafter.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                           logits_processor=t.LogitsProcessorList([Score()]), **GREEDY)
    want = reference_logits(scorer, out[:, :-1], mask, prompt_len=out.shape[1] - 1)[:, -1]
    torch.testing.assert_close(seen[-1], want, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, gpt2])
def test_chunked_prefill_whose_first_chunk_is_padding_is_refused_and_a_longer_chunk_equals_the_reference(
        build: object) -> None:
    """A row whose first chunk holds only left padding would get a plan decided from nothing (the same prompt
    alone gets another plan): refused, naming the fix; a chunk longer than the padding keeps the first chunk's
    plan (the reference decides from those positions)."""
    model = wrap(build())  # type: ignore[operator]
    ids, mask = prompts()  # rows 1 and 2 start with 2 and 4 padding tokens
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, **GREEDY)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        model.generate(**kw, prefill_chunk_size=2)
    got = model.generate(**kw, prefill_chunk_size=5)
    assert torch.equal(got, reference_greedy(model, ids, mask, 3, prompt_len=5))


@pytest.mark.parametrize("not_a_cache", [None, object(), (torch.zeros(1),)])
def test_request_plans_refuses_what_is_not_a_kv_cache(not_a_cache: object) -> None:
    with pytest.raises(TypeError, match="expected the transformers KV cache"):
        condcomp.request_plans(wrap(llama()), not_a_cache)
