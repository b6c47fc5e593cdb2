"""Tiny random models of more architectures (GPT-2, Gemma, Mixtral, Qwen3, DistilBERT, CLIP,
SigLIP, T5), and the partial-budget reference for them.

Built from transformers' config classes (nothing downloaded), float64. The reference for a partial budget is the
*unwrapped* model with the skipped heads' output-projection columns zeroed (integration_helpers explains why).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from integration_helpers import zero_heads_
from torch import Tensor, nn

t = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

DECODERS = ["gpt2", "gemma", "mixtral", "qwen3"]  # causal LMs: left padding, greedy generation through the KV cache
ARCHS = [*DECODERS, "gpt2_cross", "distilbert", "clip_text", "clip_vision", "siglip_text", "siglip_vision", "t5"]
LAYERS = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)


def build(arch: str, impl: str = "sdpa") -> nn.Module:
    kw: dict[str, Any] = {"attn_implementation": impl}
    if arch in ("gpt2", "gpt2_cross"):  # inverse-layer-idx scaling on, so a wrong scale would show
        model = t.GPT2LMHeadModel(t.GPT2Config(**kw, n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                               scale_attn_by_inverse_layer_idx=True,
                                               add_cross_attention=arch == "gpt2_cross"))
    elif arch == "gemma":  # head_dim 16 != hidden_size / heads = 8
        model = t.GemmaForCausalLM(t.GemmaConfig(**kw, **LAYERS, hidden_size=32, num_key_value_heads=2,
                                                 head_dim=16, vocab_size=100))
    elif arch == "mixtral":  # eager experts: transformers' grouped_mm experts take no float64
        model = t.MixtralForCausalLM(t.MixtralConfig(**kw, **LAYERS, hidden_size=32, num_key_value_heads=2,
                                                     vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
                                                     sliding_window=4, experts_implementation="eager"))
    elif arch == "qwen3":  # per-head q_norm / k_norm before rotary; head_dim 16 != hidden_size / heads
        model = t.Qwen3ForCausalLM(t.Qwen3Config(**kw, **LAYERS, hidden_size=32, num_key_value_heads=2, head_dim=16,
                                                 vocab_size=100))
        with torch.no_grad():  # norms that are not the identity, so a skipped or misplaced norm shows
            for m in model.modules():
                if type(m).__name__ == "Qwen3RMSNorm" and m.weight.shape == (16,):
                    m.weight.uniform_(0.5, 1.5)
    elif arch == "distilbert":
        model = t.DistilBertModel(t.DistilBertConfig(**kw, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                                     vocab_size=100))
    elif arch in ("clip_text", "siglip_text"):
        cls, cfg = (t.CLIPTextModel, t.CLIPTextConfig) if arch == "clip_text" else (t.SiglipTextModel,
                                                                                     t.SiglipTextConfig)
        model = cls(cfg(**kw, **LAYERS, hidden_size=32, vocab_size=100))
    elif arch in ("clip_vision", "siglip_vision"):
        cls, cfg = (t.CLIPVisionModel, t.CLIPVisionConfig) if arch == "clip_vision" else (t.SiglipVisionModel,
                                                                                         t.SiglipVisionConfig)
        model = cls(cfg(**kw, **LAYERS, hidden_size=32, image_size=16, patch_size=8))
    elif arch == "t5":  # few buckets and a short max distance, so that far positions share buckets
        model = t.T5ForConditionalGeneration(t.T5Config(**kw, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                                        num_heads=4, vocab_size=100, decoder_start_token_id=0,
                                                        relative_attention_num_buckets=8,
                                                        relative_attention_max_distance=6))
    else:
        raise KeyError(arch)
    return model.double().eval()


def batch(arch: str, left_pad: bool = True) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    if arch.endswith("vision"):
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)}
    ids = torch.randint(2, 100, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 6:] = 0
    if arch in DECODERS and left_pad:
        mask = mask.flip(1)
    out = {"input_ids": ids, "attention_mask": mask}
    if arch == "gpt2_cross":
        out["encoder_hidden_states"] = torch.randn(3, 5, 32, generator=g, dtype=torch.float64)
        enc_mask = torch.ones(3, 5, dtype=torch.long)
        enc_mask[0, 3:] = 0
        out["encoder_attention_mask"] = enc_mask
    if arch == "t5":
        out["decoder_input_ids"] = torch.randint(2, 100, (3, 5), generator=g)
        dec_mask = torch.ones(3, 5, dtype=torch.long)
        dec_mask[2, 3:] = 0
        out["decoder_attention_mask"] = dec_mask
    return out


def real_rows(arch: str, inputs: dict[str, Tensor]) -> Tensor | slice:
    # Decoder rows of left padding attend to nothing; transformers and condcomp fill them differently.
    return inputs["attention_mask"].bool() if arch in DECODERS else slice(None)


def _out_projection(module: nn.Module) -> tuple[nn.Module, int]:
    for name in ("o_proj", "out_proj", "out_lin", "c_proj", "o"):
        if hasattr(module, name):
            for dim in ("head_dim", "key_value_proj_dim", "attention_head_size"):
                if hasattr(module, dim):
                    return getattr(module, name), int(getattr(module, dim))
    raise KeyError(type(module).__name__)


def reference_with_heads(model: nn.Module, names: list[str], keep: list[int]) -> nn.Module:
    """A copy of the unwrapped ``model`` whose output projections only see the ``keep`` heads."""
    ref = copy.deepcopy(model)
    for name in names:
        proj, head_dim = _out_projection(ref.get_submodule(name))
        if isinstance(proj, t.pytorch_utils.Conv1D):  # weight (in, out): zero the skipped heads' rows
            with torch.no_grad():
                rows = torch.ones(proj.weight.shape[0], dtype=torch.bool)
                for h in keep:
                    rows[h * head_dim:(h + 1) * head_dim] = False
                proj.weight[rows] = 0.0
        else:
            zero_heads_(proj, keep, head_dim)  # type: ignore[arg-type]
    return ref
