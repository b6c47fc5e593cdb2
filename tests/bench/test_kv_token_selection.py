"""``bench kv``'s token-selection variants (``snapkv-0.50`` ... ``adakv-0.25``): every KV group of every layer is
held by the policy (nothing split), each keeps the fraction of the prompt kvpress's presses keep at the same
setting (per group for snapkv, per layer on average for adakv), and the cache's bytes are the compact state by hand."""

from __future__ import annotations

import pytest
import torch

import condcomp
from condcomp.bench.kv_variants import MODELS, VARIANTS, ModelContext

t = pytest.importorskip("transformers")
B, T, G, Dh = 2, 300, 2, 8  # a prompt long enough that 0.25 of it exceeds the window of 64


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=G, vocab_size=97, max_position_embeddings=512)
    return t.LlamaForCausalLM(config).eval()


def unused() -> torch.Tensor:
    raise AssertionError("a token-selection variant needs no importance ranking")


@pytest.mark.parametrize("kv", ["snapkv", "adakv"])
@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_every_group_keeps_the_fraction_and_the_bytes_are_the_state_by_hand(kv: str, fraction: float) -> None:
    from condcomp.integrations.hf.cache import cache_bytes

    name = f"{kv}-{fraction:.2f}"
    assert VARIANTS[name].model == name and VARIANTS[name].cache is None
    model = MODELS[name](llama(), ModelContext(importance=unused))
    ids = torch.randint(1, 97, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    plans = list(condcomp.request_plans(model, cache).values())
    assert {m for p in plans for row in p.group_modes() for m in row} == {kv}  # no group kept in full
    kept = int(T * fraction)  # kvpress: int(q_len * (1 - compression_ratio)), the observation window included
    for layer, nbytes in zip(cache.layers, cache_bytes(cache)):
        state = layer.condcomp_windows
        counts = (state.positions >= 0).sum(-1)  # (B, G): tokens each group keeps
        if kv == "snapkv":
            assert counts.tolist() == [[kept] * G] * B
        else:
            assert counts.sum(-1).tolist() == [kept * G] * B and bool((counts >= 64).all())  # window 64 each
        n = state.keys.shape[2]
        assert n == int(counts.max())
        placeholder = 2 * B * T * 4  # keys and values (B, 1, T, 1) float32: they count the tokens
        # keys, values, positions, and one (B,) int64 of tokens seen, which is the prompt length until a later token
        assert nbytes == 2 * B * G * n * Dh * 4 + B * G * n * 8 + B * 8 + placeholder


@pytest.mark.parametrize("name", ["snapkv-0.50", "adakv-0.50"])
def test_a_question_after_the_prefill_in_one_call_equals_feeding_it_one_token_at_a_time(name: str) -> None:
    """snapkv and adakv refuse a call of several tokens right after a prefill that may not hold the whole prompt (it
    could be a second chunk). The bench prefills inside ``plan_from_prompt`` of the prompt's width (the prompt is
    complete), so it feeds a question or a continuation in one call: its logits and greedy answers equal the model
    called once per token by hand after a prefill of its own (the reference); without ``plan_from_prompt`` the
    call of several tokens is still refused."""
    import transformers

    from condcomp.bench import kv

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    bench = kv.Bench(transformers.LlamaForCausalLM(config).eval(), torch.device("cpu"), importance=lambda: None)
    ids = torch.randint(0, 300, (2, 106), generator=torch.Generator().manual_seed(1))
    model = bench.model(kv.VARIANTS[name].model)
    with torch.inference_mode():
        _, source = bench.prefill(kv.VARIANTS[name].model, ids[:, :100])
        got, _ = bench.step(name, ids[:, 100:], bench.cache_for(name, source))  # (2, 6, V): one call
        with pytest.raises(ValueError, match="prefilled in one call.*plan_from_prompt"):
            unsaid = model(input_ids=ids[:, :100], use_cache=True).past_key_values
            model(input_ids=ids[:, 100:], cache=unsaid, use_cache=True)
        cache = model(input_ids=ids[:, :100], use_cache=True).past_key_values
        want = torch.cat([model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits
                          for i in range(100, 106)], 1)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
