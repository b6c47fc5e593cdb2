"""PEFT LoRA on wrapped projections: the wrapped model must equal the unwrapped PEFT model.

References, all independent of condcomp's LoRA reading: the PEFT model itself (outputs and LoRA gradients at the
full budget, in both orders of ``apply_`` and ``get_peft_model``), and for partial budgets the model whose
adapters PEFT merged into plain weights (``merge_and_unload``), wrapped with the same routing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import condcomp
from condcomp.projections import ProjectionError

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
from test_hf_adapters import build  # noqa: E402

TARGETS = {"llama": ["q_proj", "v_proj"], "bert": ["query", "value"]}
KEY = {"llama": "logits", "bert": "last_hidden_state"}
TOL = dict(atol=1e-10, rtol=1e-9)  # the tiny models are float64


def _lora(model: nn.Module, arch: str, **kw: Any) -> nn.Module:
    # init_lora_weights=False: B is random too, so the adapters change the output from the start.
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[arch], init_lora_weights=False, **kw)
    return peft.get_peft_model(model, cfg)


def _pair(arch: str, order: str, cfg: condcomp.CondCompConfig, **kw: Any) -> tuple[nn.Module, nn.Module]:
    """(PEFT reference, wrapped model with the same base and adapter weights)."""
    torch.manual_seed(0)
    base = build(arch)
    ref = _lora(copy.deepcopy(base), arch, **kw)
    if order == "lora_first":
        model = _lora(copy.deepcopy(base), arch, **kw)
        model.load_state_dict(ref.state_dict())
        condcomp.apply_(model, cfg)
    else:
        model = copy.deepcopy(base)
        condcomp.apply_(model, cfg)
        model = _lora(model, arch, **kw)
        model.load_state_dict(ref.state_dict(), strict=False)  # the wrapped model adds its routing state
    return ref, model


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(3))


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["gathered", "masked", "reference"])
@pytest.mark.parametrize("order", ["lora_first", "condcomp_first"])
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_full_budget_equals_the_peft_model_outputs_and_lora_gradients(arch: str, order: str, executor: str) -> None:
    cfg = condcomp.CondCompConfig(policy="full", router="random", executor=executor)
    ref, model = _pair(arch, order, cfg)
    ids = _ids()
    for m in (ref, model):
        m.train()
        m(input_ids=ids)[KEY[arch]].pow(2).mean().backward()
    ref.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids)[KEY[arch]], ref(input_ids=ids)[KEY[arch]], **TOL)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n}
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert len(grads) == len(ref_grads) == 8
    for name, g in grads.items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(g, ref_grads[name], **TOL)


@pytest.mark.slow
def test_compiled_full_budget_equals_the_peft_model() -> None:
    """``torch.compile(fullgraph=True)`` of a LoRA BERT wrapped with ``gathered`` (the capturable path): the
    adapters' merged weights are derived inside the graph (the eager path's version-keyed cache cannot be read
    there), and the output equals the PEFT model's. (A decoder's forward goes through its request plan, captured
    only on a static cache: tests/integrations/hf/test_compiled_decode.py.)"""
    arch = "bert"
    cfg = condcomp.CondCompConfig(policy="full", router="random", executor="gathered")
    ref, model = _pair(arch, "lora_first", cfg)
    ref.eval(), model.eval()
    ids = _ids()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids)[KEY[arch]]
        torch.testing.assert_close(got, ref(input_ids=ids)[KEY[arch]], **TOL)
    assert {u.strategy for u in condcomp.head_usage(model).values()} == {"sequence.static"}


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_partial_budget_equals_the_merged_peft_model(arch: str, prefer_router: str) -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router, executor="gathered")
    ref, model = _pair(arch, "lora_first", cfg)
    merged = ref.merge_and_unload()  # PEFT's own merge: plain weights W + scaling * B @ A
    condcomp.apply_(merged, cfg)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids)[KEY[arch]], merged.eval()(input_ids=ids)[KEY[arch]],
                                   **TOL)


def test_disabled_and_merged_adapters_follow_peft() -> None:
    cfg = condcomp.CondCompConfig(policy="full", router="random", executor="gathered")
    ref, model = _pair("llama", "condcomp_first", cfg)
    ids = _ids()
    ref.eval(), model.eval()
    with torch.no_grad():
        with ref.disable_adapter(), model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, **TOL)
        lora_out = ref(input_ids=ids).logits
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, lora_out, **TOL)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, lora_out, **TOL)


def test_cached_merge_follows_in_place_updates() -> None:
    """Without autograd the merged weight is cached; an optimizer-style in-place update must be seen."""
    cfg = condcomp.CondCompConfig(policy="full", router="random", executor="gathered")
    ref, model = _pair("llama", "lora_first", cfg)
    ids = _ids()
    ref.eval(), model.eval()
    with torch.no_grad():
        model(input_ids=ids)
        for m in (ref, model):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.mul_(3.0)
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, **TOL)


@pytest.mark.parametrize("order", ["lora_first", "condcomp_first"])
def test_dora_is_refused_by_name(order: str) -> None:
    cfg = condcomp.CondCompConfig(policy="full", router="random")
    with pytest.raises(ProjectionError, match=r"q_proj.*DoRA"):
        _, model = _pair("llama", order, cfg, use_dora=True)
        model(input_ids=_ids())


def test_lora_dropout_is_refused_in_training_only() -> None:
    cfg = condcomp.CondCompConfig(policy="full", router="random")
    with pytest.raises(ProjectionError, match=r"cannot wrap .*q_proj.*lora_dropout=0.1"):  # a training model
        _pair("llama", "lora_first", cfg, lora_dropout=0.1)
    torch.manual_seed(0)
    base = build("llama")
    ref = _lora(copy.deepcopy(base), "llama", lora_dropout=0.1)
    model = _lora(copy.deepcopy(base), "llama", lora_dropout=0.1).eval()
    model.load_state_dict(ref.state_dict())
    condcomp.apply_(model, cfg)  # in eval mode: accepted
    ids = _ids()
    with pytest.raises(ProjectionError, match=r"q_proj.*lora_dropout=0.1"):
        model.train()(input_ids=ids)
    with torch.no_grad():  # in eval the dropout is the identity: exact
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits, **TOL)


class PackedLinear(nn.Linear):
    """A Linear subclass whose forward is not F.linear(x, weight, bias) (a stand-in for a quantized layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_unknown_linear_subclasses_and_packed_weights_are_refused_by_name() -> None:
    model = nn.Sequential(condcomp.HeadAttention(16, 2))
    model[0].k_proj = PackedLinear(16, 16)
    with pytest.raises(ProjectionError, match=r"cannot wrap 0 .*k_proj.*PackedLinear"):
        condcomp.apply_(model, condcomp.CondCompConfig())
    assert isinstance(model[0], condcomp.HeadAttention)  # left as it was
    model[0].k_proj = nn.Linear(16, 16)
    model[0].v_proj.weight = nn.Parameter(torch.zeros(16, 16, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ProjectionError, match=r"v_proj.*int8"):
        condcomp.apply_(model, condcomp.CondCompConfig())
    offloaded = nn.Sequential(condcomp.HeadAttention(16, 2, bias=False).to("meta"))
    offloaded[0].q_proj._hf_hook = object()  # what accelerate's dispatch leaves on an offloaded layer
    with pytest.raises(ProjectionError, match=r"q_proj: its weight is offloaded"):
        condcomp.apply_(offloaded, condcomp.CondCompConfig())


def test_a_model_built_on_the_meta_device_wraps_and_materialises() -> None:
    """Deferred initialisation (FSDP2's habit): wrap on meta, then to_empty and load the real weights."""
    torch.manual_seed(0)
    ref = nn.Sequential(condcomp.HeadAttention(16, 2)).eval()
    with torch.device("meta"):
        model = nn.Sequential(condcomp.HeadAttention(16, 2))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random"))
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())  # an unwrapped state_dict: the progress buffer keeps its value
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ref(x))


def test_mixed_adapter_batches_are_refused() -> None:
    """PEFT passes ``adapter_names`` to the LoRA layers through forward hooks, which a weight read cannot honour."""
    cfg = condcomp.CondCompConfig(policy="full", router="random")
    _, model = _pair("llama", "lora_first", cfg)
    with pytest.raises(ProjectionError, match="adapter_names"):
        model.eval()(input_ids=_ids(), adapter_names=["default", "__base__"])
