"""GPT-2, Gemma, Mixtral, DistilBERT, CLIP, SigLIP and T5 x every executor.

Same contract as test_hf_adapters: full-budget parity with the unwrapped model on padded batches, ``remove_``
exact, a half budget equal to the unwrapped model with the skipped heads' output columns zeroed (arch_models).
KV-cache decoding is in test_hf_architectures_cache.py.
"""

from __future__ import annotations

import pytest
import torch
from integration_helpers import kept_heads, state_equal
from torch import nn

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
from arch_models import ARCHS, batch, build, real_rows, reference_with_heads  # noqa: E402
from test_hf_adapters import ATOL, EXECUTORS, RTOL, output  # noqa: E402

FULL = condcomp.CondCompConfig(policy="full", router="random")
# SigLIP's pooling head is an nn.MultiheadAttention called with need_weights=True (it reads only the output)
pytestmark = pytest.mark.filterwarnings("ignore:condcomp does not compute attention weights")


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
    assert [k for k in model.state_dict() if not k.endswith(".condcomp_progress")] == list(before)
    model.load_state_dict(before, strict=False)  # the unwrapped state_dict loads (progress buffers aside)
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(output(model, inputs)[rows], want[rows], atol=ATOL, rtol=RTOL)
    condcomp.remove_(model)
    assert all(model.get_submodule(n) is originals[n] for n in names)
    assert torch.equal(output(model, inputs), want)
    assert state_equal(model.state_dict(), before)


@pytest.mark.slow
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("arch", ARCHS)
def test_half_budget_equals_unwrapped_model_without_the_skipped_heads(arch: str, executor: str,
                                                                      prefer_router: str) -> None:
    model = build(arch)
    inputs = batch(arch)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router, executor=executor)
    names = condcomp.apply_(model, cfg)
    got = output(model, inputs)
    assert all(u.k_frac == 0.5 for u in condcomp.head_usage(model).values())
    condcomp.remove_(model)
    want = output(reference_with_heads(model, names, kept_heads(4, 0.5)), inputs)
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(got[rows], want[rows], atol=ATOL, rtol=RTOL)
    assert not torch.allclose(got[rows], output(model, inputs)[rows])  # the skipped heads did matter


@pytest.mark.parametrize("arch", ["gpt2", "distilbert", "clip_text", "siglip_text"])
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


@pytest.mark.parametrize("arch", ["gpt2", "clip_text", "t5"])
@pytest.mark.parametrize("executor", ["masked", "gathered"])
def test_without_attention_mask(arch: str, executor: str) -> None:
    # No mask at all: causal structure comes from the module (GPT-2, T5 decoder) or from CLIP's is_causal=True.
    model = build(arch)
    inputs = {k: v for k, v in batch(arch).items() if "attention_mask" not in k}
    want = output(model, inputs)
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor=executor))
    torch.testing.assert_close(output(model, inputs), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["gpt2", "clip_text"])
def test_causal_attention_reaches_the_routed_module(arch: str, prefer_router: str) -> None:
    model = build(arch)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router))
    ids = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 98 + 2
    a, b = output(model, {"input_ids": ids}), output(model, {"input_ids": changed})
    assert torch.equal(a[:, :-1], b[:, :-1])  # earlier positions never see the last token
    assert not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.parametrize("arch", ["gpt2", "distilbert", "t5"])
def test_eager_masks_are_read_like_sdpa_masks(arch: str) -> None:
    # eager attention passes additive float masks (finite minimum); float32 as in test_hf_adapters
    model = build(arch, impl="eager").float()
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in batch(arch).items()}
    want = output(model, inputs)
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor="reference"))
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(output(model, inputs)[rows], want[rows], atol=2e-5, rtol=1e-4)


def test_t5_position_bias_is_returned_and_shared_like_t5() -> None:
    # Wrap only the layers that compute the relative position bias: the unwrapped later layers must receive the
    # bias the wrapped first layer returns (and the reverse with only the later layers wrapped).
    for target in [["re:.*block\\.0\\..*"], ["re:.*block\\.1\\..*"]]:
        model = build("t5")
        inputs = batch("t5")
        want = output(model, inputs)
        layer = model.encoder.block[0].layer[0].SelfAttention
        x = torch.randn(2, 7, 32, dtype=torch.float64)
        _, want_bias, _ = layer(x)
        names = condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random",
                                                               target_modules=target))
        assert len(names) == 3  # encoder self, decoder self and cross-attention of that block
        torch.testing.assert_close(output(model, inputs), want, atol=ATOL, rtol=RTOL)
        _, bias, weights = model.encoder.block[0].layer[0].SelfAttention(x)
        assert torch.equal(bias, want_bias) and weights is None


def test_gpt2_reorder_and_upcast_attn_is_refused_where_it_changes_the_scores() -> None:
    # It computes the scores in float32 under eager attention only: float64 (or half) eager models are refused
    t = pytest.importorskip("transformers")
    cfg = dict(n_embd=32, n_layer=1, n_head=4, vocab_size=100, reorder_and_upcast_attn=True)
    ids = torch.tensor([[3, 4, 5, 6]])
    eager = t.GPT2Model(t.GPT2Config(**cfg, attn_implementation="eager")).eval()
    want = eager(input_ids=ids).last_hidden_state
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        condcomp.apply_(eager.double(), FULL)
    condcomp.apply_(eager.float(), FULL)  # float32: the same scores
    torch.testing.assert_close(eager(input_ids=ids).last_hidden_state, want, atol=1e-5, rtol=1e-5)
    eager.double()  # cast after wrapping: refused at the call
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        eager(input_ids=ids)
    sdpa = t.GPT2Model(t.GPT2Config(**cfg, attn_implementation="sdpa")).double().eval()
    condcomp.apply_(sdpa, FULL)  # transformers ignores the option under sdpa
    sdpa.set_attn_implementation("eager")  # switched after wrapping: refused at the call
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        sdpa(input_ids=ids)


def test_conv1d_is_read_exactly_and_subclasses_are_refused() -> None:
    from transformers.pytorch_utils import Conv1D

    from condcomp.projections import ProjectionError, linear_parts

    conv = Conv1D(6, 4).double()
    w, b = linear_parts(conv, "c_attn")
    assert w.shape == (6, 4) and w.data_ptr() == conv.weight.data_ptr() and b is conv.bias  # a view, not a copy
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert torch.equal(nn.functional.linear(x, w, b), conv(x))

    class Scaled(Conv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    with pytest.raises(ProjectionError, match="not a plain nn.Linear"):
        linear_parts(Scaled(6, 4), "c_attn")


def test_gpt2_without_scaled_attention_weights() -> None:
    # scale_attn_weights=False: scores unscaled (module.scaling = 1 / (layer_idx + 1) with the inverse-layer option)
    t = pytest.importorskip("transformers")
    model = t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, scale_attn_weights=False,
                                           scale_attn_by_inverse_layer_idx=True)).double().eval()
    inputs = batch("gpt2", left_pad=False)
    want = output(model, inputs)
    names = condcomp.apply_(model, FULL)
    assert [model.get_submodule(n).layout.scale for n in names] == [1.0, 0.5]
    torch.testing.assert_close(output(model, inputs), want, atol=ATOL, rtol=RTOL)
