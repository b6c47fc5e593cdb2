"""A wrapped transformers model round-trips through save_pretrained / from_pretrained with its routing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from integration_helpers import state_equal
from test_hf_adapters import batch, build, output

import condcomp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

from condcomp.integrations.hf.checkpoint import (  # noqa: E402
    CONFIG_FILE,
    ROUTING_FILE,
    from_pretrained,
    load_condcomp,
    save_pretrained,
)


def _perturb_routing_(model: torch.nn.Module) -> None:
    # fresh routing parameters come from the global generator: make the saved ones differ from any fresh draw
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "condcomp_" in name:
                p.add_(torch.randn_like(p))


@pytest.mark.parametrize("arch,share", [("bert", False), ("llama", True)])
def test_round_trip_restores_outputs_routing_and_keys(arch: str, share: bool, tmp_path: Path) -> None:
    model = build(arch)
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {"s_min": 0.2, "s_max": 0.8}), router="topk",
                                  share_policy=share)
    condcomp.apply_(model, cfg)
    _perturb_routing_(model)
    inputs = batch(arch)
    want = output(model, inputs)
    save_pretrained(model, tmp_path, cfg if share else None)  # None: the config apply_ used
    assert (tmp_path / CONFIG_FILE).is_file() and (tmp_path / ROUTING_FILE).is_file()

    torch.manual_seed(123)  # a different fresh draw: only the file can make the outputs equal
    loaded = from_pretrained(type(model), tmp_path, torch_dtype=torch.float64).eval()
    assert condcomp.routed_modules(loaded)
    # equal up to float64 rounding (loaded tensors may differ in memory layout); other heads would differ by O(1)
    torch.testing.assert_close(output(loaded, inputs), want, atol=1e-12, rtol=1e-12)
    assert state_equal(loaded.state_dict(), model.state_dict())

    # the weights directory stays a plain transformers checkpoint: loads without condcomp, no stray keys
    plain, info = type(model).from_pretrained(str(tmp_path), torch_dtype=torch.float64, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    condcomp.remove_(model)
    assert state_equal(plain.state_dict(), model.state_dict())


def test_routing_that_does_not_fit_is_refused_and_leaves_the_model_unwrapped(tmp_path: Path) -> None:
    model = build("bert")
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {}), router="topk")
    condcomp.apply_(model, cfg)
    save_pretrained(model, tmp_path, cfg)
    t = transformers
    other = t.BertModel(t.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=37, vocab_size=100))
    with pytest.raises(ValueError, match="does not match"):
        load_condcomp(other, tmp_path)
    assert not condcomp.routed_modules(other)
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        load_condcomp(other, tmp_path / "missing")


def test_a_model_wrapped_with_two_configs_round_trips_with_each_config(tmp_path: Path) -> None:
    model = build("bert")
    first_layer = condcomp.CondCompConfig(policy=("budgetformer", {}), router=("topk", {"gates": "weighted"}),
                                          target_modules="re:.*layer\\.0\\..*")
    condcomp.apply_(model, first_layer)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk"))
    _perturb_routing_(model)
    inputs = batch("bert")
    want = output(model, inputs)
    save_pretrained(model, tmp_path)
    torch.manual_seed(321)
    loaded = from_pretrained(type(model), tmp_path, torch_dtype=torch.float64).eval()
    configs = {n: m.condcomp_config for n, m in condcomp.routed_modules(loaded).items()}
    assert configs == {n: m.condcomp_config for n, m in condcomp.routed_modules(model).items()}
    torch.testing.assert_close(output(loaded, inputs), want, atol=1e-12, rtol=1e-12)


def test_round_trip_restores_schedule_progress(tmp_path: Path) -> None:
    """Weighted gates make eval outputs depend on the temperature schedule: a progress lost to 0.0 shows."""
    model = build("bert")
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"gates": "weighted"}))
    condcomp.apply_(model, cfg)
    _perturb_routing_(model)
    condcomp.set_progress(model, 0.9)
    inputs = batch("bert")
    want = output(model, inputs)
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(type(model), tmp_path, torch_dtype=torch.float64).eval()
    assert [h.progress for h in condcomp.api.routing_hosts(loaded).values()] == [0.9, 0.9]
    torch.testing.assert_close(output(loaded, inputs), want, atol=1e-12, rtol=1e-12)


def test_a_flipped_byte_in_the_routing_file_is_detected(tmp_path: Path) -> None:
    from condcomp.checkpoint import CheckpointError

    model = build("bert")
    condcomp.apply_(model, condcomp.CondCompConfig(policy="budgetformer", router="topk"))
    save_pretrained(model, tmp_path)
    f = tmp_path / ROUTING_FILE
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside the tensor data: safetensors still parses it, only a checksum can tell
    f.write_bytes(bytes(data))
    fresh = build("bert")
    with pytest.raises(CheckpointError, match="corrupt: SHA-256"):
        load_condcomp(fresh, tmp_path)
    assert not condcomp.routed_modules(fresh)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_native_save_pretrained_round_trip(arch: str, tmp_path: Path) -> None:
    """transformers' own save_pretrained (what Trainer and push_to_hub call) writes everything needed; two apply_
    calls with different configs and the schedule progress come back."""
    model = build(arch)
    layer0 = "re:.*layers?\\.0\\..*" if arch == "llama" else "re:.*layer\\.0\\..*"
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("budgetformer", {}), router=("topk", {"gates": "weighted"}),
                                                   target_modules=layer0))
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk"))
    _perturb_routing_(model)
    condcomp.set_progress(model, 0.6)
    inputs = batch(arch)
    want = output(model, inputs)
    model.save_pretrained(str(tmp_path))
    torch.manual_seed(321)
    loaded = from_pretrained(type(model), tmp_path, torch_dtype=torch.float64).eval()
    assert sorted(condcomp.routed_modules(loaded)) == sorted(condcomp.routed_modules(model))
    assert [h.progress for h in condcomp.api.routing_hosts(loaded).values()] == [0.6, 0.6]
    torch.testing.assert_close(output(loaded, inputs), want, atol=1e-12, rtol=1e-12)
    assert state_equal(loaded.state_dict(), model.state_dict())
    # A plain from_pretrained loads the dense weights (the routing keys are reported as unexpected, left out).
    plain, info = type(model).from_pretrained(str(tmp_path), torch_dtype=torch.float64, output_loading_info=True)
    assert any("condcomp_policy" in k for k in info["unexpected_keys"]) and not info["missing_keys"]
    condcomp.remove_(model)
    assert not hasattr(model.config, "condcomp")  # the record goes with the routing
    assert state_equal(plain.state_dict(), model.state_dict())


def test_from_pretrained_of_a_folder_without_routing_says_so(tmp_path: Path) -> None:
    build("bert").save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="holds no condcomp routing"):
        from_pretrained(transformers.BertModel, tmp_path)
