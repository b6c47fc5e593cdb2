"""Checkpoints transformers itself reads in more than one way: a base model loaded from a folder saved with a head
(and the reverse), and static pruning with one ``apply_`` per layer. Oracles: the saved model's own outputs and
the unwrapped model with the pruned heads' output-projection columns zeroed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import condcomp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install condcomp[hf])")

from condcomp.integrations.hf import checkpoint as hf_checkpoint  # noqa: E402

IDS = torch.tensor([[3, 17, 5, 9, 41, 2, 8], [11, 4, 30, 6, 7, 22, 1]])
# (layer, query heads kept): 4 heads in 2 KV groups; each layer keeps a different group
STATIC = [(0, [0, 1]), (1, [2, 3])]


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=37, vocab_size=50, max_position_embeddings=64)


def _routed(cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    model = cls(_config()).eval()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk"))
    with torch.no_grad():  # saved routing that no fresh draw reproduces
        for name, p in model.named_parameters():
            if "condcomp_" in name:
                p.add_(torch.randn_like(p))
    condcomp.set_progress(model, 0.7)
    return model


def _hidden(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).last_hidden_state


def _save(model: torch.nn.Module, directory: Path, layout: str) -> None:
    if layout == "native":
        model.save_pretrained(str(directory))
    else:
        hf_checkpoint.save_pretrained(model, directory)


@pytest.mark.parametrize("layout", ["native", "condcomp_files"])
def test_a_base_model_loads_from_a_causal_lm_folder(layout: str, tmp_path: Path) -> None:
    lm = _routed(transformers.LlamaForCausalLM)
    want = _hidden(lm.model)
    with condcomp.disabled(lm):
        dense = _hidden(lm.model)
    assert (want - dense).abs().max() > 1e-3  # the routing skips heads: a reload without it would show
    _save(lm, tmp_path, layout)
    torch.manual_seed(1)
    base = hf_checkpoint.from_pretrained(transformers.LlamaModel, tmp_path).eval()
    assert sorted(condcomp.routed_modules(base)) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert [h.progress for h in condcomp.api.routing_hosts(base).values()] == pytest.approx([0.7, 0.7])
    torch.testing.assert_close(_hidden(base), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["native", "condcomp_files"])
def test_a_causal_lm_loads_from_a_base_model_folder(layout: str, tmp_path: Path) -> None:
    base = _routed(transformers.LlamaModel)
    want = _hidden(base)
    _save(base, tmp_path, layout)
    torch.manual_seed(1)
    lm = hf_checkpoint.from_pretrained(transformers.LlamaForCausalLM, tmp_path).eval()  # a new lm_head, as transformers
    assert sorted(condcomp.routed_modules(lm)) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    torch.testing.assert_close(_hidden(lm.model), want, rtol=1e-5, atol=1e-6)


def _static_pruned() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The docs/llm.md recipe (one ``apply_`` per layer, the ``static`` router) and its oracle: the unwrapped
    model with the dropped heads' output-projection columns zeroed."""
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(_config()).eval()
    oracle = copy.deepcopy(dense)
    head_dim = 32 // 4
    for layer, keep in STATIC:
        condcomp.apply_(dense, condcomp.CondCompConfig(policy="full", router=("static", {"heads": keep}),
                                                       target_modules=[f"model.layers.{layer}.self_attn"]))
        with torch.no_grad():
            for h in set(range(4)) - set(keep):
                oracle.model.layers[layer].self_attn.o_proj.weight[:, h * head_dim:(h + 1) * head_dim] = 0
    return dense, oracle


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_static_pruning_per_layer_round_trips_through_the_condcomp_files(tmp_path: Path) -> None:
    pruned, oracle = _static_pruned()
    want = _logits(oracle)
    torch.testing.assert_close(_logits(pruned), want, rtol=1e-5, atol=1e-6)
    hf_checkpoint.save_pretrained(pruned, tmp_path)
    loaded = hf_checkpoint.from_pretrained(transformers.LlamaForCausalLM, tmp_path).eval()
    torch.testing.assert_close(_logits(loaded), want, rtol=1e-5, atol=1e-6)
    # saved again from the reloaded model: still one record per layer
    hf_checkpoint.save_pretrained(loaded, tmp_path / "again")
    again = hf_checkpoint.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "again").eval()
    torch.testing.assert_close(_logits(again), want, rtol=1e-5, atol=1e-6)


def test_a_config_given_at_save_applies_to_every_wrapped_module(tmp_path: Path) -> None:
    pruned, _ = _static_pruned()
    first = condcomp.routed_modules(pruned)["model.layers.0.self_attn"].condcomp_config
    with pytest.warns(UserWarning, match=r"replaces the config.*model\.layers\.1\.self_attn"):
        hf_checkpoint.save_pretrained(pruned, tmp_path, config=first)
    loaded = hf_checkpoint.from_pretrained(transformers.LlamaForCausalLM, tmp_path).eval()
    assert sorted(condcomp.routed_modules(loaded)) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    # the oracle of that request: heads 0 and 1 kept in both layers
    torch.manual_seed(0)
    oracle = transformers.LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        for layer in (0, 1):
            oracle.model.layers[layer].self_attn.o_proj.weight[:, 16:] = 0
    torch.testing.assert_close(_logits(loaded), _logits(oracle), rtol=1e-5, atol=1e-6)
