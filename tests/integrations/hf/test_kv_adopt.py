"""``condcomp.kv.adopt``: condcomp's cache layer installed on a cache the user builds (a ``DynamicCache``, an fp8
``QuantizedCache``) decodes the same tokens as the cache a wrapped model adopts by itself and as the references of
the other KV tests (the unwrapped model at the full budget; the cache-free reference executor with plans from the
prompt otherwise); adopting twice changes nothing; an adopted cache survives pickle and deepcopy."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from condcomp.integrations.hf.kv_layer import PlanLayer
from decode_helpers import GREEDY, extend, llama, prompts, reference_greedy, step, t, wrap

import condcomp

NEW = 4


def kw(ids: torch.Tensor, mask: torch.Tensor) -> dict[str, object]:
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)


def test_an_adopted_dynamic_cache_decodes_as_the_automatic_path_and_the_reference() -> None:
    model = wrap(llama(kv_heads=4), 0.5)
    ids, mask = prompts()
    cache = condcomp.kv.adopt(t.DynamicCache())  # empty: its layers are built wrapped
    got = model.generate(**kw(ids, mask), past_key_values=cache)
    assert len(cache.layers) == 2 and all(isinstance(layer, PlanLayer) for layer in cache.layers)
    assert all(type(layer.inner) is t.cache_utils.DynamicLayer for layer in cache.layers)
    assert torch.equal(got, model.generate(**kw(ids, mask)))  # the cache generate builds, adopted by the model
    assert torch.equal(got, reference_greedy(model, ids, mask, NEW))
    plans = condcomp.request_plans(model, cache)
    assert plans and all(p.compact for p in plans.values())


def test_an_adopted_fp8_cache_equals_the_unwrapped_model_at_the_full_budget_and_the_automatic_path_at_half() -> None:
    dense = llama(kv_heads=4)
    ids, mask = prompts()
    fp8 = dict(cache_implementation="quantized", cache_config={"backend": "fp8"})
    full = wrap(copy.deepcopy(dense), policy="full")
    cache = condcomp.kv.adopt(t.QuantizedCache("fp8", full.config))
    assert all(isinstance(layer, PlanLayer) and isinstance(layer.inner, t.cache_utils.Fp8QuantizedLayer)
               for layer in cache.layers)
    assert torch.equal(full.generate(**kw(ids, mask), past_key_values=cache), dense.generate(**kw(ids, mask), **fp8))
    half = wrap(copy.deepcopy(dense), 0.5)
    cache = condcomp.kv.adopt(t.QuantizedCache("fp8", half.config))
    got = half.generate(**kw(ids, mask), past_key_values=cache)
    assert torch.equal(got, half.generate(**kw(ids, mask), **fp8))
    codes = [layer._quantized_keys[0] for layer in cache.layers]  # read through to the fp8 layer's own codes
    assert all(c.dtype == torch.float8_e4m3fn and c.shape[1] == 2 for c in codes)  # 2 of 4 groups, in fp8


def test_adopting_twice_changes_nothing() -> None:
    cache = t.DynamicCache(config=llama().config)
    once = condcomp.kv.adopt(cache)
    layers, factory = list(cache.layers), cache.layer_class_to_replicate
    assert condcomp.kv.adopt(once) is cache
    assert all(a is b for a, b in zip(cache.layers, layers)) and cache.layer_class_to_replicate is factory
    assert not any(isinstance(layer.inner, PlanLayer) for layer in cache.layers)
    lazy = condcomp.kv.adopt(condcomp.kv.adopt(t.DynamicCache()))
    lazy.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    assert type(lazy.layers[0]) is PlanLayer and type(lazy.layers[0].inner) is t.cache_utils.DynamicLayer


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_an_adopted_cache_round_trips_and_continues_as_the_original(how: str) -> None:
    model = wrap(llama(kv_heads=4), 0.5)
    ids, mask = prompts()
    cache = condcomp.kv.adopt(t.DynamicCache())
    logits = step(model, ids, mask, cache, ids.shape[1])
    copied = pickle.loads(pickle.dumps(cache)) if how == "pickle" else copy.deepcopy(cache)
    assert all(isinstance(layer, PlanLayer) for layer in copied.layers)
    for a, b in zip(cache.layers, copied.layers):
        assert torch.equal(a.keys, b.keys) and a.keys is not b.keys
        assert torch.equal(a.condcomp_plan.plan.active, b.condcomp_plan.plan.active)
    nxt = logits.argmax(-1, keepdim=True)
    tokens, full = extend(ids, mask, nxt)
    torch.testing.assert_close(step(model, tokens, full, copied, 1), step(model, tokens, full, cache, 1),
                               rtol=0, atol=0)
    empty = pickle.loads(pickle.dumps(condcomp.kv.adopt(t.DynamicCache())))  # its factory pickles too
    empty.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    assert isinstance(empty.layers[0], PlanLayer)


def test_an_encoder_decoder_cache_has_both_halves_adopted_and_other_objects_are_refused() -> None:
    cache = condcomp.kv.adopt(t.EncoderDecoderCache(t.DynamicCache(), t.DynamicCache()))
    for half in (cache.self_attention_cache, cache.cross_attention_cache):
        half.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
        assert isinstance(half.layers[0], PlanLayer)
    with pytest.raises(TypeError, match="expected a transformers Cache"):
        condcomp.kv.adopt([torch.zeros(1)])

    class PagedAttentionCache:  # recognised by its class name, as transformers' own
        layers: list[object] = []

    with pytest.raises(ValueError, match="continuous batching"):
        condcomp.kv.adopt(PagedAttentionCache())
