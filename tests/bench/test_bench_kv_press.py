"""kvpress's presses in ``bench kv`` on transformers 5: the argument adapter lets the press's hook find the cache,
the evicted cache equals the press's rule applied by hand, and tokens after it read it at their true positions
(reference: the plain model on the whole sequence with the evicted keys masked for the later tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("kvpress", exc_type=ImportError)
transformers = pytest.importorskip("transformers")


def one_layer_llama(layers: int = 1, heads: int = 2, kv_heads: int = 1, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=300,
                                      max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


def test_adapter_names() -> None:
    from condcomp.bench.kv_press import kvpress_kwargs

    cache, pos = object(), torch.arange(5, 9).unsqueeze(0)
    got = kvpress_kwargs({"cache": cache, "position_ids": pos}, 4)
    assert got["past_key_values"] is cache and got["cache_position"].tolist() == [5, 6, 7, 8]
    assert kvpress_kwargs({"cache": cache}, 3)["cache_position"].tolist() == [0, 1, 2]


def test_knorm_press_evicts_by_key_norm_and_later_tokens_keep_their_positions() -> None:
    from condcomp.bench import kv

    model = one_layer_llama()
    bench = kv.Bench(model, torch.device("cpu"), importance=lambda: None)
    ids = torch.randint(0, 300, (1, 45), generator=torch.Generator().manual_seed(1))
    P = 40
    with torch.inference_mode():
        dense = model(input_ids=ids[:, :P], use_cache=True).cache
    keys = dense.layers[0].keys  # (1, 1, P, Dh)
    kept = (-keys.norm(dim=-1))[0, 0].topk(P // 2).indices.sort().values  # KNorm: the smallest key norms kept
    with torch.inference_mode():
        _, cache = bench.prefill("kvpress-knorm-0.50", ids[:, :P])
        held = cache.layers[0].keys  # (1, 1, P / 2, Dh)
        assert held.shape[2] == P // 2  # the hook found the cache through the adapter and evicted half
        order = held[0, 0].norm(dim=-1).sort().indices
        torch.testing.assert_close(held[0, 0][order], keys[0, 0, kept][keys[0, 0, kept].norm(dim=-1).sort().indices])
        logits, _ = bench.step("kvpress-knorm-0.50", ids[:, P:], bench.cache_for("kvpress-knorm-0.50", cache))
    # reference: the whole sequence at once; the 5 later tokens see the kept context tokens and each other
    allowed = torch.tril(torch.ones(45, 45, dtype=torch.bool))
    evicted = torch.ones(P, dtype=torch.bool)
    evicted[kept] = False
    allowed[P:, :P] &= ~evicted
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=allowed[None, None]).logits[:, P:]
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, model(input_ids=ids).logits[:, P:], atol=1e-3)  # the eviction shows


@pytest.mark.parametrize("name", ["kvpress-streaming-0.25", "kvpress-snapkv-0.50", "kvpress-expected-0.50",
                                  "kvpress-tova-0.25", "kvpress-adakv-snapkv-0.50"])
def test_every_press_runs_and_holds_its_fraction(name: str) -> None:
    from condcomp.bench import kv
    from condcomp.bench.kv_variants import cache_bytes

    model = one_layer_llama()
    bench = kv.Bench(model, torch.device("cpu"), importance=lambda: None)
    ids = torch.randint(0, 300, (2, 128), generator=torch.Generator().manual_seed(2))  # SnapKV: > its 64 window
    with torch.inference_mode():
        _, dense = bench.prefill("dense", ids)
        _, cache = bench.prefill(name, ids)
        frac = cache_bytes(cache) / cache_bytes(dense)  # before the next tokens add theirs
        logits, _ = bench.step(name, ids[:, :3], cache)
    assert torch.isfinite(logits).all()
    want = 1.0 if "adakv" in name else float(name.rsplit("-", 1)[1])  # AdaKV masks keys: nothing freed
    assert frac == pytest.approx(want)


def test_duo_press_streams_the_lowest_gates_and_reports_its_nominal_bytes(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.bench import kv, kv_press
    from condcomp.bench.kv_variants import cache_bytes
    from condcomp.experiments.llm.duo_gates import FORMAT

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=3, vocab_size=300,
                                      max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).eval()
    gates = tmp_path / "gates.json"
    # group 0 kept in full
    gates.write_text(json.dumps({"format": FORMAT, "sinks": 4, "window": 252, "scores": [[0.9, 0.1, 0.5]]}))
    name = "kvpress-duo-gates-1of3"
    monkeypatch.setitem(kv_press.PRESS_VARIANTS, name, kv_press.PressVariant(
        kv_press._duo(gates, 1 / 3), "test", headwise=True, needs=gates))
    bench = kv.Bench(model, torch.device("cpu"), importance=lambda: None)
    ids = torch.randint(0, 300, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        _, dense = bench.prefill("dense", ids)
        dense_logits, _ = bench.step("dense", ids[:, :2], bench.cache_for("dense", dense))
        _, cache = bench.prefill(name, ids)
        assert cache_bytes(cache) == cache_bytes(dense)  # masked, nothing freed
        masked = model.model.layers[0].self_attn.masked_key_indices  # (batch, head, position) of masked keys
        logits, _ = bench.step(name, ids[:, :2], cache)
    assert sorted(set(masked[1].tolist())) == [1, 2]  # the two lowest gates stream
    assert sorted(set(masked[2].tolist())) == list(range(4, 300 - 252))  # 4 sinks and 252 recent tokens kept
    assert not torch.allclose(logits, dense_logits, atol=1e-4)  # the masking is read
    assert kv_press.nominal_fraction(name, model, 300) == pytest.approx(1 - 2 / 3 * (1 - 256 / 300))


def test_snapkv_refuses_a_prompt_shorter_than_its_window() -> None:
    from condcomp.bench import kv

    bench = kv.Bench(one_layer_llama(), torch.device("cpu"), importance=lambda: None)
    with pytest.raises(ValueError, match="kvpress-snapkv-0.50 needs prompts of 65 tokens or more, got 32"):
        bench.prefill("kvpress-snapkv-0.50", torch.zeros(1, 32, dtype=torch.long))


def test_eviction_presses_served_by_the_dense_prefill_hold_what_their_own_prefills_hold() -> None:
    """Every eviction press captured together during one dense prefill (kv_press.captured) against the press
    applied alone by kvpress's own hook, layer by layer; the dense cache stays whole, and the next tokens read the
    shared cache as they read the press's own."""
    from condcomp.bench import kv, kv_press

    names = [n for n, v in kv_press.PRESS_VARIANTS.items() if not v.headwise]
    assert len(names) == 10 and all(kv.VARIANTS[n].model == "dense" for n in names)  # one group with dense
    model = one_layer_llama(layers=2, heads=4, kv_heads=2, seed=4)
    bench = kv.Bench(model, torch.device("cpu"), importance=lambda: None)
    ids = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=True).cache
        _, dense = bench.prefill("dense", ids, ["dense", *names])
        for layer, whole in zip(dense.layers, plain.layers):  # the captures left the dense cache whole
            assert torch.equal(layer.keys, whole.keys) and torch.equal(layer.values, whole.values)
        shared = {n: bench.cache_for(n, dense) for n in names}
        for name in names:
            _, own = bench.prefill(name, ids)  # kvpress's hook compresses the cache during this prefill
            held = shared[name]
            assert held.get_seq_length() < 100  # something was evicted
            for a, b in zip(held.layers, own.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), name
            got, _ = bench.step(name, ids[:, :3], held)
            want, _ = bench.step(name, ids[:, :3], own)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
