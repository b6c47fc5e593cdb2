"""``bench kv``'s split from a gates file: the kept-full groups are the globally highest gates (layers may keep
all or none), every other group streams, and the cache a prefill fills holds exactly that per layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import condcomp
from condcomp.bench.kv_variants import MODELS, VARIANTS, ModelContext, gate_split
from condcomp.experiments.llm.duo_gates import save_gates

t = pytest.importorskip("transformers")


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return t.LlamaForCausalLM(config).eval()


def unused() -> torch.Tensor:
    raise AssertionError("a gates split needs no importance ranking")


@pytest.mark.parametrize("scores,modes", [
    ([[0.9, 0.8], [0.1, 0.2]], [["full", "full"], ["window", "window"]]),  # one layer keeps both, one none
    ([[0.9, 0.1], [0.2, 0.8]], [["full", "window"], ["window", "full"]]),
])
def test_the_cache_holds_the_highest_half_of_the_gates_in_full(tmp_path: Path, scores: list[list[float]],
                                                                modes: list[list[str]]) -> None:
    path = tmp_path / "gates.json"
    save_gates(path, "duo", "tiny", torch.tensor(scores), 2, 3, {})
    model = gate_split(path, 0.5, window=3, sinks=2)(llama(), ModelContext(importance=unused))
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    plans = list(condcomp.request_plans(model, out.past_key_values).values())
    assert [p.group_modes()[0] for p in plans] == modes
    assert all(p.group_modes()[0] == p.group_modes()[1] for p in plans)  # static: every request the same split


def test_a_missing_gates_file_says_how_to_make_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="condcomp calibrate-kv --method duo"):
        gate_split(tmp_path / "none.json", 1 / 3, 252)(llama(), ModelContext(importance=unused))
    assert VARIANTS["split-duo-1of3"].model in MODELS
