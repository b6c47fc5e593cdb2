"""A KV policy that keeps the groups a plan does not keep is refused at attach time where the adapter cannot hold
it (GPT-2, the attention-function attachment): those used to cache every head and silently drop the groups
(red team round 4, items 1-2). ``kv="drop"`` (the default) still attaches."""

from __future__ import annotations

import warnings

import pytest
import torch

import condcomp

t = pytest.importorskip("transformers")


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=32)).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=50)
    return t.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("options", [
    {"kv": ("window", {"sinks": 1, "window": 4})},
    {"kv": "full"},
    {"router": ("topk", {"kv_groups": True, "stream_window": 4, "stream_sinks": 1})},
])
def test_gpt2_refuses_a_kv_policy_it_cannot_hold_and_stays_unwrapped(options: dict[str, object]) -> None:
    model = gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), **options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"apply_: .*silently drop those groups.*kv='drop'"):
        condcomp.apply_(model, cfg)
    assert condcomp.routed_modules(model) == {}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5})))  # drop attaches


def test_the_attention_function_attachment_refuses_a_window_policy() -> None:
    from condcomp.integrations.hf.interface import apply_interface_, cores

    model = llama()
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"kv_groups": True}),
                                  kv=("window", {"sinks": 1, "window": 4}))
    with pytest.raises(ValueError, match="apply_interface_: kv='window'"):
        apply_interface_(model, cfg)
    assert cores(model) == {}
    assert condcomp.apply_(model, cfg)  # the module swap holds it on a Llama
