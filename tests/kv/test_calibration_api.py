"""The public calibration names in ``condcomp.kv.calibration``: a DuoAttention split from a gates file in one call
(string paths accepted), a static split from an importance ranking, and the committed gates file loading by its
string path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import condcomp
from condcomp.experiments.llm.duo_gates import save_gates
from condcomp.kv import calibration

t = pytest.importorskip("transformers")
ROOT = Path(__file__).parents[2]


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=97, max_position_embeddings=64)
    return t.LlamaForCausalLM(config).eval()


def modes_after_prefill(model: torch.nn.Module) -> list[list[list[str]]]:
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return [p.group_modes() for p in condcomp.request_plans(model, out.past_key_values).values()]


def test_duo_split_from_a_string_path_keeps_the_globally_highest_gates_and_streams_the_rest(tmp_path: Path) -> None:
    scores = [[0.9, 0.1, 0.5, 0.3], [0.8, 0.7, 0.2, 0.05]]
    path = tmp_path / "gates.json"
    save_gates(path, "duo", "tiny", torch.tensor(scores), 2, 3, {})
    model = calibration.duo_split(llama(), str(path), 0.5)
    # by hand: the 4 highest of the 8 (layer, group) gates: 0.9, 0.8, 0.7, 0.5
    want = [["full", "window", "full", "window"], ["full", "full", "window", "window"]]
    got = modes_after_prefill(model)
    assert [layer[0] for layer in got] == want and all(layer[0] == layer[1] for layer in got)
    configs = [r.condcomp_config.kv for r in condcomp.routed_modules(model).values()]
    assert configs == [("window", {"sinks": 2, "window": 3})] * 2  # the file's sinks and window
    with pytest.raises(ValueError, match="fraction must be in"):
        calibration.duo_split(llama(), str(path), 1.5)


def test_static_split_keeps_each_layers_top_ranked_groups() -> None:
    importance = torch.tensor([[1.0, 4.0, 3.0, 2.0], [5.0, 1.0, 2.0, 6.0]], dtype=torch.float64)
    model = calibration.static_split(llama(), importance, 0.5, window=3, sinks=1)
    got = modes_after_prefill(model)
    assert [layer[0] for layer in got] == [["window", "full", "full", "window"], ["full", "window", "window", "full"]]
    with pytest.raises(ValueError, match=r"importance has shape \(1, 4\)"):
        calibration.static_split(llama(), importance[:1], 0.5)


def test_the_committed_gates_file_loads_from_a_string_path() -> None:
    path = ROOT / "results" / "kv" / "duo_gates.json"
    record = calibration.load_gates(str(path), 30, 3)
    assert record["scores"].shape == (30, 3) and record["window"] == 252 and record["sinks"] == 4
    with pytest.raises(FileNotFoundError, match="calibrate-kv --method duo"):
        calibration.load_gates("no/such/gates.json", 30, 3)


def test_static_split_refuses_non_finite_importance() -> None:
    """Red team round 5: a NaN importance was ranked as the most important group, silently."""
    importance = torch.tensor([[float("nan"), 1.0, 2.0, 3.0], [1.0, 2.0, float("inf"), 4.0]])
    model = llama()
    with pytest.raises(ValueError, match=r"non-finite scores at \(layer, group\) \[\[0, 0\], \[1, 2\]\]"):
        calibration.static_split(model, importance, 0.5)
    assert condcomp.routed_modules(model) == {}


@pytest.mark.parametrize("field, value", [("window", 3.7), ("window", "3"), ("sinks", True), ("sinks", -1)])
def test_a_gates_file_with_a_streaming_pattern_that_is_not_an_int_is_refused(tmp_path: Path, field: str,
                                                                            value: object) -> None:
    """Red team round 5: int(3.7), int("3") and True were read as windows of 3, 3 and sinks of 1, silently."""
    import json

    path = tmp_path / "gates.json"
    save_gates(path, "duo", "tiny", torch.ones(2, 4), 2, 3, {})
    record = json.loads(path.read_text())
    record[field] = value
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=f"{field} must be an int >= .*got {value!r}"):
        calibration.duo_split(llama(), path, 0.5)


def test_a_split_of_a_model_with_a_wrapped_layer_is_refused_before_any_layer_changes(tmp_path: Path) -> None:
    """Red team round 5: the split wrapped layer 0, then failed at the already wrapped layer 1, leaving a mix."""
    path = tmp_path / "gates.json"
    save_gates(path, "duo", "tiny", torch.rand(2, 4), 1, 3, {})
    model = llama()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   target_modules=["model.layers.1.self_attn"]))
    for split in (lambda: calibration.duo_split(model, path, 0.5),
                  lambda: calibration.static_split(model, torch.rand(2, 4), 0.5)):
        with pytest.raises(ValueError, match=r"\['model.layers.1.self_attn'\] are already wrapped.*remove_"):
            split()
        assert list(condcomp.routed_modules(model)) == ["model.layers.1.self_attn"]



@pytest.mark.parametrize("change, says", [
    ({"window": 3.7}, r"routers.pt: window must be an int >= 1, got 3.7"),
    ({"keep": 4}, r"keep must be an int in \[1, 3\], got 4"),
    ({"sinks": True}, r"routers.pt: sinks must be an int >= 0, got True"),
    ({"nan": True}, r"layer\(s\) \[1\] hold non-finite weights"),
])
def test_a_router_file_with_bad_settings_or_weights_is_refused(tmp_path: Path, change: dict[str, object],
                                                              says: str) -> None:
    """Red team round 5: int() read 3.7 as a window of 3, and NaN scorer weights picked groups arbitrarily."""
    from condcomp.experiments.llm.request_split import RequestSplit, save_router

    model = llama()
    path = tmp_path / "routers.pt"
    save_router(path, RequestSplit(64, 8, 4, [[0.0] * 4] * 2, keep=1, sinks=1, window=3), "tiny", model, {}, [])
    record = torch.load(path, weights_only=True)
    if change.pop("nan", False):
        next(iter(record["scorers"][1].values())).fill_(float("nan"))
    record.update(change)
    torch.save(record, path)
    with pytest.raises(ValueError, match=says):
        calibration.request_split(model, path)
    assert condcomp.routed_modules(model) == {}
