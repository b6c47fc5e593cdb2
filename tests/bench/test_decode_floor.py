"""``bench decode``'s ``floor_<f>``: a dense model with only the kept KV groups, against the dense model whose
dropped query heads write nothing (their output projection's columns zeroed), in float64."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from condcomp.bench.decode_floor import floor_model, kept_groups
from condcomp.cli import main

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")


def _gqa_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=3, head_dim=16, vocab_size=101, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).double().eval()


def test_kept_groups_follow_the_budget_rule_and_keep_at_least_one() -> None:
    assert [kept_groups(3, f) for f in (1 / 3, 0.34, 2 / 3, 1.0, 0.01)] == [1, 1, 2, 3, 1]
    assert [kept_groups(8, f) for f in (0.25, 0.5, 0.125, 0.33, 0.6)] == [2, 4, 1, 2, 4]  # floor(8 f), not round
    # GQA: floor(f H) query heads in whole groups: 0.3 of 32 heads is 9 heads, 3 groups of 4 (round(0.3 * 8) = 2)
    assert [kept_groups(8, f, num_heads=32) for f in (0.3, 0.33, 0.01)] == [3, 3, 1]


def _llama(heads: int, kv_heads: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=8 * heads, intermediate_size=32, num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=50, max_position_embeddings=32)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (32, 8), (9, 3)])
@pytest.mark.parametrize("fraction", ["0.33", "0.3", "0.6", "0.01", "1"])
def test_the_floor_keeps_as_many_groups_as_keep_f_holds_in_its_cache(heads: int, kv_heads: int,
                                                                      fraction: str) -> None:
    import condcomp
    from condcomp.bench.decode import variants

    models = variants(_llama(heads, kv_heads), names=[f"keep_{fraction}", f"floor_{fraction}"])
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = models[f"keep_{fraction}"](input_ids=ids, use_cache=True).past_key_values
    (plan,) = condcomp.request_plans(models[f"keep_{fraction}"], cache).values()
    held = {len(groups) for groups in plan.kept_kv_groups()}  # each row's kept groups (a fixed budget: one count)
    assert held == {models[f"floor_{fraction}"].config.num_key_value_heads}


@pytest.mark.parametrize("fraction", [1 / 3, 2 / 3])
def test_the_floor_equals_dense_with_the_dropped_heads_writing_nothing(fraction: float) -> None:
    dense = _gqa_llama()
    floor = floor_model(dense, fraction)
    kept = kept_groups(3, fraction)
    assert (floor.config.num_key_value_heads, floor.config.num_attention_heads) == (kept, 2 * kept)
    assert dense.config.num_key_value_heads == 3  # the dense model is not cut
    # the reference: dense, with the output projection's columns of every query head past the kept groups' zeroed
    # (head h reads group h // 2; heads are consecutive blocks of 16 columns)
    reference = copy.deepcopy(dense)
    for layer in reference.model.layers:
        layer.self_attn.o_proj.weight.data[:, 2 * kept * 16:] = 0
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = floor(input_ids=ids).logits, reference(input_ids=ids).logits
        assert not torch.allclose(got, dense(input_ids=ids).logits)  # the cut changes the model
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_module_without_a_transformers_config_is_refused() -> None:
    with pytest.raises(ValueError, match="no transformers config.*Llama-family"):
        floor_model(nn.Linear(2, 2), 0.5)


def test_a_model_without_projected_attention_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    model.config = type("Config", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 4})()
    with pytest.raises(ValueError, match="no q/k/v/o-projection attention.*Llama-family"):
        floor_model(model, 0.5)


@pytest.mark.slow
def test_the_compiled_bench_times_the_floor_and_pairs_every_run_with_the_faster_dense(tmp_path: Path) -> None:
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--compile", "--compile-backend", "eager",
                 "--variants", "floor_0.25", "--out", str(tmp_path)]) == 0
    by = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert list(by) == ["dense", "floor_0.25", "dense+compiled", "floor_0.25+compiled"]
    faster = by["dense"]["faster_dense"]
    assert faster in ("dense", "dense+compiled") and all(r["faster_dense"] == faster for r in by.values())
    assert by[faster]["decode_ratio_faster_dense"] == 1.0  # each of its steps paired with itself
    floor = by["floor_0.25+compiled"]
    assert floor["k_frac"] == 0.25 and floor["compiles"] == 1 and floor["tokens_equal_eager"]
    # static caches of prompt 16 + 4 tokens, per layer (4): 2 of 8 heads x (B=2) x 20 x 64 dims x (K and V) x 4
    # bytes, + the int64 token count
    assert floor["kv_bytes"] == 4 * (2 * (2 * 20 * 64 * 2 * 4) + 8)
    assert "| x faster dense |" in (tmp_path / "table.md").read_text()
