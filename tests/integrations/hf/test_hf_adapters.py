"""transformers module swap: every supported architecture x every executor against the unwrapped model.

Tiny random models built from configs (no downloads), float64 so that "equal" means equal up to summation order.
Partial budgets are checked against the unwrapped model with the skipped heads' output columns zeroed
(integration_helpers), padded batches row by row against unpadded single examples, decoding through the KV cache
against the unwrapped model's greedy generation.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from integration_helpers import kept_heads, state_equal, zero_heads_
from torch import Tensor, nn

import condcomp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

EXECUTORS = condcomp.list_executors()
ATOL, RTOL = 1e-10, 1e-9  # float64
ENCODERS = ["bert", "roberta", "vit"]
DECODERS = ["llama", "qwen2", "mistral"]
ARCHS = [*ENCODERS, *DECODERS, "bert_decoder"]
# RoBERTa and Qwen2 share BERT's and Llama's adapters and pass the full-budget grid; the costlier grids skip them.
PARTIAL_ARCHS = ["bert", "vit", "llama", "mistral", "bert_decoder"]
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)


def build(arch: str, impl: str = "sdpa") -> nn.Module:
    t = transformers
    kw: dict[str, Any] = {**COMMON, "attn_implementation": impl}
    if arch == "bert":
        model = t.BertModel(t.BertConfig(**kw, vocab_size=100))
    elif arch == "roberta":
        model = t.RobertaModel(t.RobertaConfig(**kw, vocab_size=100, pad_token_id=1))
    elif arch == "vit":
        model = t.ViTModel(t.ViTConfig(**kw, image_size=16, patch_size=8))
    elif arch == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**kw, num_key_value_heads=2, vocab_size=100))
    elif arch == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**kw, num_key_value_heads=2, vocab_size=100))
    elif arch == "mistral":  # a window shorter than the inputs, so the sliding mask matters
        model = t.MistralForCausalLM(t.MistralConfig(**kw, num_key_value_heads=2, vocab_size=100, sliding_window=3))
    elif arch == "bert_decoder":
        model = t.BertLMHeadModel(t.BertConfig(**kw, vocab_size=100, is_decoder=True, add_cross_attention=True))
    else:
        raise KeyError(arch)
    return model.double().eval()


def batch(arch: str, left_pad: bool = True) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    if arch == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)}
    ids = torch.randint(2, 100, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 6:] = 0
    if arch in DECODERS and left_pad:
        mask = mask.flip(1)
    out = {"input_ids": ids, "attention_mask": mask}
    if arch == "bert_decoder":
        out["encoder_hidden_states"] = torch.randn(3, 5, 32, generator=g, dtype=torch.float64)
        enc_mask = torch.ones(3, 5, dtype=torch.long)
        enc_mask[0, 3:] = 0
        out["encoder_attention_mask"] = enc_mask
    return out


def output(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def real_rows(arch: str, inputs: dict[str, Tensor]) -> Tensor | slice:
    # Decoder rows of left padding attend to nothing; transformers and condcomp fill them differently.
    return inputs["attention_mask"].bool() if arch in DECODERS else slice(None)


def reference_with_heads(model: nn.Module, names: list[str], keep: list[int]) -> nn.Module:
    """A copy of the unwrapped ``model`` whose output projections only see the ``keep`` heads."""
    ref = copy.deepcopy(model)
    for name in names:
        module = ref.get_submodule(name)
        if hasattr(module, "o_proj"):
            zero_heads_(module.o_proj, keep, module.head_dim)
        else:
            zero_heads_(module.output.dense, keep, module.self.attention_head_size)
    return ref


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("arch", ARCHS)
def test_full_budget_parity_and_exact_remove(arch: str, executor: str) -> None:
    model = build(arch)
    inputs = batch(arch)
    want = output(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    originals = dict(model.named_modules())
    names = condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor=executor))
    assert names and all(isinstance(model.get_submodule(n), condcomp.RoutedAttention) for n in names)
    # Keys unchanged ("full" and "random" have no parameters) but for each layer's saved training progress.
    assert [k for k in model.state_dict() if not k.endswith(".condcomp_progress")] == list(before)
    assert sorted(k for k in model.state_dict() if k.endswith(".condcomp_progress")) == sorted(
        f"{n}.condcomp_progress" for n in names)
    model.load_state_dict(before)  # a state_dict of the unwrapped model loads strictly
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(output(model, inputs)[rows], want[rows], atol=ATOL, rtol=RTOL)
    condcomp.remove_(model)
    assert all(model.get_submodule(n) is originals[n] for n in names)
    assert torch.equal(output(model, inputs), want)
    assert state_equal(model.state_dict(), before)


@pytest.mark.parametrize("arch", ["bert", "llama", "mistral", "bert_decoder"])
def test_eager_masks_are_read_like_sdpa_masks(arch: str) -> None:
    # eager attention hands modules additive float masks (finite minimum, not -inf) instead of bool ones. float32:
    # in float64, transformers' own eager Llama turns left-padding rows into NaN (minimum + minimum = -inf).
    model = build(arch, impl="eager").float()
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in batch(arch).items()}
    want = output(model, inputs)
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor="reference"))
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(output(model, inputs)[rows], want[rows], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("arch", PARTIAL_ARCHS)
def test_partial_budget_equals_unwrapped_model_without_the_skipped_heads(arch: str, executor: str,
                                                                         prefer_router: str) -> None:
    model = build(arch)
    inputs = batch(arch)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router, executor=executor)
    keep = kept_heads(4, 0.5)
    names = condcomp.apply_(model, cfg)
    got = output(model, inputs)
    condcomp.remove_(model)
    want = output(reference_with_heads(model, names, keep), inputs)
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(got[rows], want[rows], atol=ATOL, rtol=RTOL)
    assert not torch.allclose(got[rows], output(model, inputs)[rows])  # the skipped heads did matter


@pytest.mark.parametrize("arch", ["bert", "roberta", "llama", "mistral"])
def test_padded_batch_row_by_row_against_single_unpadded_examples(arch: str, prefer_router: str) -> None:
    model = build(arch)
    inputs = batch(arch, left_pad=False)
    names = condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router))
    got = output(model, inputs)
    condcomp.remove_(model)
    ref = reference_with_heads(model, names, kept_heads(4, 0.5))
    for b, m in enumerate(inputs["attention_mask"].bool()):
        single = {"input_ids": inputs["input_ids"][b:b + 1, m], "attention_mask": inputs["attention_mask"][b:b + 1, m]}
        torch.testing.assert_close(got[b, m], output(ref, single)[0], atol=ATOL, rtol=RTOL,
                                   msg=lambda msg, b=b: f"row {b}: {msg}")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_causal_mask_reaches_the_routed_attention(arch: str, prefer_router: str) -> None:
    model = build(arch)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router))
    ids = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 98 + 2
    a, b = model(input_ids=ids).logits, model(input_ids=changed).logits
    assert torch.equal(a[:, :-1], b[:, :-1])  # earlier positions never see the last token
    assert not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.parametrize("arch,fraction", [("llama", 0.5), ("qwen2", 1.0), ("mistral", 0.5)])
def test_kv_cache_generation_matches_the_unwrapped_model(arch: str, fraction: float, prefer_router: str) -> None:
    model = build(arch)
    ids = torch.randint(2, 100, (2, 5), generator=torch.Generator().manual_seed(4))
    names = condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}),
                                                           router=prefer_router))
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    condcomp.remove_(model)
    ref = reference_with_heads(model, names, kept_heads(4, fraction))
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_training_gradients_match_the_reference(prefer_router: str) -> None:
    model = build("bert").train()  # dropout 0.1 in the config: turn it off so that both runs see the same net
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    inputs = batch("bert")
    names = condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router))
    output(model, inputs).square().sum().backward()
    condcomp.remove_(model)
    ref = reference_with_heads(model, names, kept_heads(4, 0.5))
    ref.zero_grad()
    output(ref, inputs).square().sum().backward()
    for name in ("query.weight", "key.weight", "value.weight"):
        got = model.encoder.layer[0].attention.self.get_parameter(name).grad
        want = ref.encoder.layer[0].attention.self.get_parameter(name).grad
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_default_targets_one_module_per_layer_and_patterns() -> None:
    bert, llama = build("bert"), build("llama")
    cfg = condcomp.CondCompConfig(policy="full", router="random")
    assert condcomp.apply_(bert, cfg) == ["encoder.layer.0.attention", "encoder.layer.1.attention"]
    assert condcomp.apply_(llama, condcomp.CondCompConfig(policy="full", router="random",
                                                          target_modules="re:model\\.layers\\.0\\.self_attn")) \
        == ["model.layers.0.self_attn"]
    condcomp.remove_(llama)
    assert condcomp.apply_(llama, condcomp.CondCompConfig(policy="full", router="random", target_modules=".self_attn",
                                                          exclude_modules="model.layers.1.self_attn")) \
        == ["model.layers.0.self_attn"]
    with pytest.raises(ValueError, match="BertSelfAttention"):  # the core alone is not the wrapped unit
        condcomp.apply_(build("bert"), condcomp.CondCompConfig(policy="full", router="random",
                                                               target_modules="encoder.layer.0.attention.self"))


def _phi3() -> nn.Module:  # fused qkv_proj: no adapter reads it (the attention-function attachment does)
    t = transformers
    return t.Phi3Model(t.Phi3Config(**COMMON, num_key_value_heads=2, vocab_size=100, pad_token_id=0,
                                    eos_token_id=1, bos_token_id=1))


def test_model_without_supported_attention_names_found_and_supported_classes() -> None:
    with pytest.raises(ValueError) as err:
        condcomp.apply_(_phi3(), condcomp.CondCompConfig(policy="full", router="random"))
    message = str(err.value)
    assert "Phi3Attention" in message and "BertAttention" in message and "LlamaAttention" in message


def test_lookalike_class_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.integrations import hf
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    monkeypatch.setattr(hf.ProjectionAttentionAdapter, "module_types", hf.ProjectionAttentionAdapter.module_types)
    hf.register_transformers_attention(Phi3Attention, "projection")
    with pytest.raises(ValueError, match="qkv_proj"):
        condcomp.apply_(_phi3(), condcomp.CondCompConfig(policy="full", router="random"))
    with pytest.raises(ValueError, match="family"):
        hf.register_transformers_attention(Phi3Attention, "gpt")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_bert_decoder_self_and_cross_attention_cache(executor: str, prefer_router: str) -> None:
    # transformers' own generate() fails for BertLMHeadModel with encoder states (DynamicCache has no is_updated),
    # so the cache is driven by hand: a 4-token prefix, then 2 more tokens reusing self- and cross-attention K/V.
    from transformers import DynamicCache, EncoderDecoderCache

    model = build("bert_decoder")
    g = torch.Generator().manual_seed(5)
    ids, enc = torch.randint(2, 100, (2, 6), generator=g), torch.randn(2, 5, 32, generator=g, dtype=torch.float64)

    def cached_logits(m: nn.Module) -> Tensor:
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        first = m(input_ids=ids[:, :4], encoder_hidden_states=enc, cache=cache, use_cache=True).logits
        return torch.cat([first, m(input_ids=ids[:, 4:], encoder_hidden_states=enc, cache=cache,
                                   use_cache=True).logits], 1)

    names = condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router,
                                                           executor=executor))
    assert any(n.endswith("crossattention") for n in names)
    got = cached_logits(model)
    condcomp.remove_(model)
    ref = reference_with_heads(model, names, kept_heads(4, 0.5))
    torch.testing.assert_close(got, cached_logits(ref), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, ref(input_ids=ids, encoder_hidden_states=enc).logits, atol=ATOL, rtol=RTOL)


def test_rotary_module_called_without_position_embeddings_is_a_clear_error() -> None:
    model = build("llama")
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random"))
    with pytest.raises(ValueError, match="position_embeddings"):
        model.model.layers[0].self_attn(torch.randn(1, 3, 32, dtype=torch.float64), attention_mask=None)
