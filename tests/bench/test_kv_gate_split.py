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


def test_the_mixture_gates_variants_read_the_committed_1024_token_gates() -> None:
    """split-duo1024-*: gates files trained by `calibrate-kv --mix` at 1024 tokens (SmolLM2: 30 layers x 3 groups),
    one per seed, the split a third (or a sixth) of the 90 groups."""
    from condcomp.bench.kv_variants import MIX_GATES
    from condcomp.experiments.llm.duo_gates import load_gates, split_from_scores

    root = Path(__file__).resolve().parents[2]
    seeds = []
    for path in MIX_GATES:
        record = load_gates(root / path, 30, 3)
        assert record["settings"]["rows"] == "mix" and record["settings"]["seq_len"] == 1024
        assert (record["sinks"], record["window"]) == (4, 252)
        seeds.append(record["settings"]["seed"])
        assert sum(map(len, split_from_scores(record["scores"], 1 / 3))) == 30
    assert seeds == [0, 1]
    for name in ("split-duo1024-1of3", "split-duo1024-1of3-seed1", "split-duo1024-1of6-w92"):
        assert VARIANTS[name].model in MODELS and VARIANTS[name].cache is None
