"""Bad input gets a clear error that names the problem (and, where there is one, what to do)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import condcomp
from condcomp.registry import POLICIES


def routed(**kw: object) -> condcomp.RoutedAttention:
    layer = condcomp.HeadAttention(16, 4, **kw)  # type: ignore[arg-type]
    return condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(policy="full", router="random"))


def test_wrong_input_rank_and_width() -> None:
    r = routed()
    with pytest.raises(ValueError, match=r"expected input of shape \(B, T, D=16\), got \(5, 16\)"):
        r(torch.randn(5, 16))
    with pytest.raises(ValueError, match="input width 15 does not match the layer's d_model=16"):
        r(torch.randn(2, 5, 15))
    with pytest.raises(TypeError, match="must be floating point"):
        r(torch.ones(2, 5, 16, dtype=torch.long))


def test_masks_of_the_wrong_shape() -> None:
    r = routed()
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"padding mask must be \(B, T\) = \(2, 5\), got \(2, 6\)"):
        r(x, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key padding mask must be \(B, S\) = \(2, 5\), got \(5,\)"):
        r(x, None, key_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_bias \(2, 4, 5, 6\) does not broadcast to \(B, H, T, S\)"):
        r(x, attn_bias=torch.zeros(2, 4, 5, 6))
    with pytest.raises(ValueError, match=r"rotary cos/sin must be \(B, T, Dh\) = \(2, 5, 4\)"):
        r(x, rotary=(torch.ones(2, 5, 3), torch.zeros(2, 5, 3)))


def test_cross_attention_inputs_of_the_wrong_shape() -> None:
    r = routed(kdim=12, vdim=10)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"key input must be \(B=2, S, Dk=12\), got \(2, 6, 11\)"):
        r(x, key=torch.randn(2, 6, 11), value=torch.randn(2, 6, 10))
    with pytest.raises(ValueError, match=r"value input must be \(B, S, Dv\) = \(2, 6, 10\)"):
        r(x, key=torch.randn(2, 6, 12), value=torch.randn(2, 7, 10))  # SDPA would silently accept this one


def test_multihead_attention_inputs_of_the_wrong_shape() -> None:
    model = nn.Sequential()
    model.add_module("mha", nn.MultiheadAttention(16, 4))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random"))
    x = torch.randn(5, 2, 16)
    with pytest.raises(ValueError, match=r"must all be \(T, D\) or all 3-D \(\(T, B, D\)\)"):
        model.mha(x[0, 0], x[0, 0], x[0, 0], need_weights=False)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, S\) = \(2, 5\), got \(5, 2\)"):
        model.mha(x, x, x, key_padding_mask=torch.zeros(5, 2, dtype=torch.bool), need_weights=False)
    with pytest.raises(ValueError, match=r"attn_mask must be \(T, S\) = \(5, 5\) or \(B\*H, T, S\)"):
        model.mha(x, x, x, attn_mask=torch.zeros(4, 4), need_weights=False)


def test_unknown_registry_keys_list_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="unknown policy 'budget'; registered policies: .*fixed.*full"):
        condcomp.CondCompConfig(policy="budget")
    with pytest.raises(KeyError, match="unknown router 'nope'; registered routers: .*random"):
        condcomp.CondCompConfig(policy="full", router="nope")
    with pytest.raises(KeyError, match="unknown executor 'fast'; registered executors: .*masked.*reference"):
        condcomp.CondCompConfig(policy="full", router="random", executor="fast")


def test_unknown_or_misplaced_config_options() -> None:
    with pytest.raises(TypeError, match=r"policy 'fixed' has no option 'fracton'; its options are: \['fraction'"):
        condcomp.CondCompConfig(policy=("fixed", {"fracton": 0.5}), router="random")
    with pytest.raises(TypeError, match="'num_heads' is taken from the wrapped layer, not the config"):
        condcomp.CondCompConfig(policy=("fixed", {"num_heads": 4}), router="random")
    with pytest.raises(TypeError, match="policy must be a key like 'fixed' or a pair"):
        condcomp.CondCompConfig(policy=0.5, router="random")
    with pytest.raises(ValueError, match=r"unknown CondCompConfig fields \['polcy'\]"):
        condcomp.CondCompConfig.from_dict({"polcy": "full"})
    with pytest.raises(TypeError, match="target_modules must be None, a string or a list of strings"):
        condcomp.CondCompConfig(policy="full", router="random", target_modules=3)


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_outside_unit_interval(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"fixed policy: fraction .* must be a finite number >= 0 and <= 1, got"):
        condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}), router="random")
    with pytest.raises(ValueError, match=r"fixed policy: fraction .* >= 0 and <= 1"):
        POLICIES.get("fixed")(num_heads=4, fraction=fraction)


def test_fixed_policy_k_min_above_the_layer_heads() -> None:
    net = nn.Sequential()
    net.add_module("attn", condcomp.HeadAttention(16, 4))
    with pytest.raises(ValueError, match="k_min=6 exceeds the layer's 4 heads"):
        condcomp.apply_(net, condcomp.CondCompConfig(policy=("fixed", {"k_min": 6}), router="random"))


def test_apply_matching_nothing_lists_the_attention_modules_it_saw() -> None:
    model = nn.Sequential()
    model.add_module("self_attn", nn.MultiheadAttention(16, 4))
    model.add_module("ff", nn.Linear(16, 16))
    cfg = condcomp.CondCompConfig(policy="full", router="random", target_modules="layers.0.attn")
    with pytest.raises(ValueError, match=r"matched no attention module.*self_attn \(MultiheadAttention\)"
                                         r".*supported classes: .*HeadAttention.*MultiheadAttention"):
        condcomp.apply_(model, cfg)
    with pytest.raises(ValueError, match="matched no attention module. Attention-like modules in the model: none"):
        condcomp.apply_(nn.Sequential(nn.Linear(4, 4)), condcomp.CondCompConfig(policy="full", router="random"))
    cfg = condcomp.CondCompConfig(policy="full", router="random", target_modules="ff")
    with pytest.raises(ValueError, match=r"target 're:ff' matches modules that are not supported attention modules: "
                                         r"\{'ff': 'Linear'\}"):
        condcomp.apply_(model, cfg)
    # A broad regex that selects an attention module may match other modules too: only the attention is wrapped.
    cfg = condcomp.CondCompConfig(policy="full", router="random", target_modules="re:.*")
    assert condcomp.apply_(model, cfg) == ["self_attn"]


def test_unsupported_options_and_modules_are_named() -> None:
    model = nn.Sequential()
    model.add_module("mha", nn.MultiheadAttention(16, 4, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"cannot wrap mha \(MultiheadAttention\): add_bias_kv=True"):
        condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random"))
    with pytest.raises(TypeError, match=r"\(Linear\) is not a supported attention module; supported: "):
        condcomp.RoutedAttention.wrap(nn.Linear(4, 4), condcomp.CondCompConfig(policy="full", router="random"))


def test_router_returning_a_plan_of_the_wrong_shape(restore_registries: None) -> None:
    @condcomp.register_router("test_wrong_shape")
    class WrongShape(nn.Module):
        granularity = "sequence"

        def forward(self, x, mask, budget, attn):  # noqa: ANN001, ANN201
            return condcomp.plan_from_active(torch.ones(x.shape[0], 3, dtype=torch.bool))

    layer = condcomp.HeadAttention(16, 4)
    r = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(policy="full", router="test_wrong_shape"))
    with pytest.raises(ValueError, match=r"router WrongShape returned a sequence plan with gates \(2, 3\); "
                                         r"expected \(2, 4\)"):
        r(torch.randn(2, 5, 16))


def test_executor_that_cannot_run_says_why(restore_registries: None) -> None:
    @condcomp.register_executor("test_picky")
    class Picky:
        name = "test_picky"
        granularities = ("sequence",)

        def supports(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return "only runs on Tuesdays"

        def __call__(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            raise AssertionError("never called")

    layer = condcomp.HeadAttention(16, 4)
    r = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(policy="full", router="random",
                                                                     executor="test_picky"))
    with pytest.raises(RuntimeError, match="executor 'test_picky' cannot run this call: only runs on Tuesdays"):
        r(torch.randn(2, 5, 16))


def test_check_inputs_rejects_non_finite_values() -> None:
    layer = condcomp.HeadAttention(16, 4)
    cfg = condcomp.CondCompConfig(policy="full", router="random", check_inputs=True)
    r = condcomp.RoutedAttention.wrap(layer, cfg)
    x = torch.randn(3, 5, 16)
    x[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite values \(NaN or inf\) in the attention input of examples \[1\]"):
        r(x)


def test_shared_policy_across_layers_of_different_head_counts() -> None:
    model = nn.Module()
    model.a = condcomp.HeadAttention(16, 4)
    model.b = condcomp.HeadAttention(16, 8)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random", share_policy=True)
    with pytest.raises(ValueError, match=r"share_policy=True needs the same number of heads.*'a': 4, 'b': 8"):
        condcomp.apply_(model, cfg)
    assert not condcomp.routed_modules(model)  # nothing was half-applied


def test_the_model_itself_being_an_attention_module() -> None:
    with pytest.raises(ValueError, match=r"the model itself is an attention module: use condcomp.RoutedAttention.wrap"):
        condcomp.apply_(nn.MultiheadAttention(16, 4), condcomp.CondCompConfig(policy="full", router="random"))


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_a_module_that_cannot_be_wrapped_leaves_the_model_untouched() -> None:
    """The second layer has an unsupported option: the first must not stay wrapped, nested tensors stay on."""
    layers = [nn.TransformerEncoderLayer(16, 4, 32, batch_first=True) for _ in range(2)]
    encoder = nn.TransformerEncoder(layers[0], num_layers=2, enable_nested_tensor=True)
    assert encoder.use_nested_tensor
    encoder.layers[1].self_attn = nn.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True)
    with pytest.raises(ValueError, match=r"cannot wrap layers.1.self_attn \(MultiheadAttention\): add_bias_kv"):
        condcomp.apply_(encoder, condcomp.CondCompConfig(policy="full", router="random"))
    assert not condcomp.routed_modules(encoder) and encoder.use_nested_tensor
