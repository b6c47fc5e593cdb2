"""nn.MultiheadAttention and nn.TransformerEncoder(Layer): full-budget parity with the unwrapped module for every
executor, exact ``remove_``, fused fast paths that must not bypass routing, shared parameters."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import pytest
import torch
from core_helpers import Holder
from torch import Tensor, nn

import condcomp

EXECUTORS = [*condcomp.list_executors(), "auto"]
D, H = 16, 4


def full_cfg(executor: str = "auto") -> condcomp.CondCompConfig:
    return condcomp.CondCompConfig(policy="full", router="random", executor=executor)


def half_cfg() -> condcomp.CondCompConfig:
    return condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random")


def mha_case(name: str) -> tuple[dict[str, Any], tuple[Tensor, ...], dict[str, Any]]:
    """Module options, positional (query, key, value) and keyword inputs of one nn.MultiheadAttention situation."""
    B, T, S = 3, 5, 6
    opts: dict[str, Any] = {"batch_first": True, "dropout": 0.1}
    kw: dict[str, Any] = {}
    x = torch.randn(B, T, D, dtype=torch.float64)
    args: tuple[Tensor, ...] = (x, x, x)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 3:] = True  # True = padding in torch's convention
    if name == "seq_first":
        opts["batch_first"] = False
        xt = x.transpose(0, 1)
        args = (xt, xt, xt)
        kw["key_padding_mask"] = pad
    elif name == "unbatched":
        args = (x[0], x[0], x[0])
        kw["attn_mask"] = torch.rand(T, T, dtype=torch.float64)
    elif name == "cross_kdim_vdim":
        opts.update(kdim=12, vdim=10)
        key_pad = torch.zeros(B, S, dtype=torch.bool)
        key_pad[0, 4:] = True
        args = (x, torch.randn(B, S, 12, dtype=torch.float64), torch.randn(B, S, 10, dtype=torch.float64))
        kw["key_padding_mask"] = key_pad
    elif name == "cross_same_dim":
        mem = torch.randn(B, S, D, dtype=torch.float64)
        args = (x, mem, mem)
    elif name == "bool_key_padding":
        kw["key_padding_mask"] = pad
    elif name == "float_key_padding":
        kw["key_padding_mask"] = torch.randn(B, T, dtype=torch.float64).clamp_max(0) * 3  # additive, finite
    elif name == "attn_mask_2d_bool":
        kw["attn_mask"] = torch.rand(T, T) < 0.3
        kw["attn_mask"].fill_diagonal_(False)  # every query keeps a key
        kw["key_padding_mask"] = pad
    elif name == "attn_mask_3d_float":
        kw["attn_mask"] = torch.randn(B * H, T, T, dtype=torch.float64)
    elif name == "is_causal":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
        kw["is_causal"] = True
    elif name == "causal_with_padding":
        kw["attn_mask"] = torch.ones(T, T, dtype=torch.bool).triu(1)  # bool, like the padding mask
        kw["is_causal"] = True
        kw["key_padding_mask"] = pad
    elif name == "no_bias":
        opts["bias"] = False
    return opts, args, kw


MHA_CASES = ["plain", "seq_first", "unbatched", "cross_kdim_vdim", "cross_same_dim", "bool_key_padding",
             "float_key_padding", "attn_mask_2d_bool", "attn_mask_3d_float", "is_causal", "causal_with_padding",
             "no_bias"]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention_full_budget_parity_and_exact_remove(case: str, training: bool) -> None:
    opts, args, kw = mha_case(case)
    if training:
        opts["dropout"] = 0.0  # dropout draws differ between implementations; parity needs it off
    model = Holder(**opts).double().train(training)
    original = model.attn
    want = model(*args, **kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for executor in EXECUTORS:
        names = condcomp.apply_(model, full_cfg(executor))
        assert names == ["attn"] and isinstance(model.attn, condcomp.RoutedAttention)
        got = model(*args, **kw)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9, msg=lambda m, e=executor: f"{e}: {m}")
        condcomp.remove_(model)
        assert model.attn is original and model.training == training
        assert torch.equal(model(*args, **kw), want)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_need_weights_warns_once_and_returns_none() -> None:
    mha = Holder(batch_first=True)
    condcomp.apply_(mha, full_cfg())
    x = torch.randn(2, 3, D)
    with pytest.warns(UserWarning, match="does not compute attention weights"):
        out, weights = mha.attn(x, x, x)
    assert weights is None and out.shape == (2, 3, D)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mha.attn(x, x, x)


def padded_batch(batch_first: bool) -> tuple[Tensor, Tensor]:
    x = torch.randn(3, 6, D, dtype=torch.float64)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 2:] = True
    return (x if batch_first else x.transpose(0, 1)), pad


def encoder_layer(batch_first: bool, norm_first: bool) -> nn.TransformerEncoderLayer:
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=32, dropout=0.0, batch_first=batch_first,
                                       norm_first=norm_first)
    return layer.double()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_layer_parity_in_training_and_in_eval_fast_path(batch_first: bool, norm_first: bool) -> None:
    layer = encoder_layer(batch_first, norm_first)
    x, pad = padded_batch(batch_first)
    real = ~pad if batch_first else ~pad.T  # compare real tokens: the fused kernel may leave padding rows apart
    layer.train()
    want_train = layer(x, src_key_padding_mask=pad)
    layer.eval()
    with torch.no_grad():  # eval + no_grad: nn.TransformerEncoderLayer takes its fused fast path when it can
        want_eval = layer(x, src_key_padding_mask=pad)
    for executor in EXECUTORS:
        condcomp.apply_(layer, full_cfg(executor))
        layer.train()
        torch.testing.assert_close(layer(x, src_key_padding_mask=pad), want_train, atol=1e-10, rtol=1e-9)
        layer.eval()
        with torch.no_grad():
            got = layer(x, src_key_padding_mask=pad)
        torch.testing.assert_close(got[real], want_eval[real], atol=1e-10, rtol=1e-9)
        condcomp.remove_(layer)
    with torch.no_grad():
        assert torch.equal(layer(x, src_key_padding_mask=pad), want_eval)


@pytest.mark.parametrize("batch_first", [True, False])
def test_fast_path_does_not_bypass_routing(batch_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the heads must change the output in eval + no_grad, where the fused kernel would run all heads."""
    fused_calls: list[int] = []
    fused = torch._transformer_encoder_layer_fwd

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        fused_calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", spy)
    layer = encoder_layer(batch_first, norm_first=False).eval()
    x, pad = padded_batch(batch_first)
    with torch.no_grad():
        want = layer(x, src_key_padding_mask=pad)
        took_fast_path = len(fused_calls)
        condcomp.apply_(layer, half_cfg())
        got = layer(x, src_key_padding_mask=pad)
    assert took_fast_path == (1 if batch_first else 0)  # torch only fuses batch_first layers
    assert len(fused_calls) == took_fast_path, "the wrapped layer still ran the fused kernel"
    routed = layer.self_attn
    assert isinstance(routed, condcomp.RoutedAttention) and routed.last is not None
    assert routed.last.plan.counts.tolist() == [2, 2, 2]
    real = ~pad if batch_first else ~pad.T
    diff = (got - want).abs().amax(-1)[real]
    assert bool((diff > 1e-3).all()), "half the heads left the output unchanged: routing was bypassed"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_encoder_nested_tensor_path_is_disabled_then_restored() -> None:
    encoder = nn.TransformerEncoder(encoder_layer(True, False), num_layers=2, enable_nested_tensor=True).eval()
    assert encoder.use_nested_tensor
    x, pad = padded_batch(True)
    with torch.no_grad():
        want = encoder(x, src_key_padding_mask=pad)  # nested tensors: padding rows come back as zeros
        names = condcomp.apply_(encoder, full_cfg("masked"))
        assert names == ["layers.0.self_attn", "layers.1.self_attn"] and not encoder.use_nested_tensor
        got = encoder(x, src_key_padding_mask=pad)
        torch.testing.assert_close(got[~pad], want[~pad], atol=1e-10, rtol=1e-9)
        condcomp.remove_(encoder)
        condcomp.apply_(encoder, half_cfg())
        assert not torch.allclose(encoder(x, src_key_padding_mask=pad)[~pad], want[~pad])
        condcomp.remove_(encoder)
        assert encoder.use_nested_tensor
        assert torch.equal(encoder(x, src_key_padding_mask=pad), want)


class ParamPolicy(nn.Module):
    """A learned constant budget: one parameter, to show condcomp_* state_dict keys."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.logit = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor, mask: Tensor | None) -> condcomp.Budget:
        s = torch.sigmoid(self.logit).expand(x.shape[0])
        return condcomp.Budget(s=s, k=condcomp.budget_k(s, self.num_heads))


def test_state_dict_keys_and_parameter_identity(restore_registries: None) -> None:
    condcomp.register_policy("test_param_policy")(ParamPolicy)
    model = nn.TransformerEncoder(encoder_layer(True, False), num_layers=2, enable_nested_tensor=False)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    condcomp.apply_(model, condcomp.CondCompConfig(policy="test_param_policy", router="random"))
    new_keys = list(model.state_dict())
    added = [k for k in new_keys if k not in keys]
    assert [k for k in new_keys if k in keys] == keys
    assert sorted(added) == ["layers.0.self_attn.condcomp_policy.logit", "layers.0.self_attn.condcomp_progress",
                             "layers.1.self_attn.condcomp_policy.logit", "layers.1.self_attn.condcomp_progress"]
    wrapped = dict(model.named_parameters())
    for name, p in params.items():
        assert wrapped[name] is p, f"{name} was copied instead of viewed"
    # the canonical weights are views of the fused in_proj parameter, not copies
    w = model.layers[0].self_attn.weights()
    assert w.q_weight.data_ptr() == params["layers.0.self_attn.in_proj_weight"].data_ptr()
    assert w.k_weight._base is params["layers.0.self_attn.in_proj_weight"]


def test_optimizer_step_through_the_wrapper_trains_the_original() -> None:
    layer = encoder_layer(True, False)
    original = layer.self_attn
    reference = copy.deepcopy(layer)
    start = original.in_proj_weight.detach().clone()
    condcomp.apply_(layer, full_cfg())
    x, pad = padded_batch(True)
    for model in (layer, reference):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x, src_key_padding_mask=pad).square().mean().backward()
        opt.step()
    assert not torch.equal(original.in_proj_weight, start)
    # identical steps: the wrapper's gradient is the unwrapped module's gradient, and it lands in the original
    torch.testing.assert_close(original.in_proj_weight, reference.self_attn.in_proj_weight, atol=1e-12, rtol=0)
    torch.testing.assert_close(original.out_proj.weight, reference.self_attn.out_proj.weight, atol=1e-12, rtol=0)
    condcomp.remove_(layer)
    assert layer.self_attn is original


@pytest.mark.parametrize("batch_first", [True, False])
def test_decoder_layer_self_and_cross_attention_parity(batch_first: bool) -> None:
    """Both attention modules of nn.TransformerDecoderLayer: causal self-attention and padded cross-attention."""
    layer = nn.TransformerDecoderLayer(D, H, dim_feedforward=32, dropout=0.0, batch_first=batch_first).double()
    tgt, _ = padded_batch(batch_first)
    memory = torch.randn(3, 7, D, dtype=torch.float64)
    memory = memory if batch_first else memory.transpose(0, 1)
    memory_pad = torch.zeros(3, 7, dtype=torch.bool)
    memory_pad[1, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    kw = dict(tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=memory_pad)
    want = layer(tgt, memory, **kw)
    for executor in EXECUTORS:
        assert condcomp.apply_(layer, full_cfg(executor)) == ["self_attn", "multihead_attn"]
        torch.testing.assert_close(layer(tgt, memory, **kw), want, atol=1e-10, rtol=1e-9)
        condcomp.remove_(layer)
    assert torch.equal(layer(tgt, memory, **kw), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_wrapped_model_survives_deepcopy_pickle_checkpoints_and_dtype_conversion() -> None:
    torch.manual_seed(1)
    plain = encoder_layer(True, False)
    layer = encoder_layer(True, False)
    condcomp.apply_(layer, full_cfg())
    layer.load_state_dict(plain.state_dict())  # a checkpoint of the unwrapped model loads by the same names
    x, pad = padded_batch(True)
    want = plain(x, src_key_padding_mask=pad)
    torch.testing.assert_close(layer(x, src_key_padding_mask=pad), want, atol=1e-10, rtol=1e-9)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        routed = twin.self_attn
        assert routed.in_proj_weight is routed.base.in_proj_weight  # still views, not copies, in the twin
        torch.testing.assert_close(twin(x, src_key_padding_mask=pad), want, atol=1e-10, rtol=1e-9)
        condcomp.remove_(twin)
        torch.testing.assert_close(twin(x, src_key_padding_mask=pad), want, atol=1e-10, rtol=1e-9)
    # with parameter replacement on conversion, .float() swaps the wrapper's parameters: remove_ hands them back
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        layer.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    original = layer.self_attn.base
    condcomp.remove_(layer)
    assert layer.self_attn is original and original.in_proj_weight.dtype == torch.float32
    torch.testing.assert_close(layer(x.float(), src_key_padding_mask=pad), want.float(), atol=1e-5, rtol=1e-4)
