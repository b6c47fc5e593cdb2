"""PEFT LoRA on GPT-2's Conv1D projections (``fan_in_fan_out=True``) against the unwrapped PEFT model.

As in test_peft_lora: full budget equal to the PEFT model (outputs and LoRA gradients, both orders of ``apply_``
and ``get_peft_model``); half budget equal to PEFT's merged model wrapped the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
from arch_models import build  # noqa: E402
from gpt2_lora import lora_pair  # noqa: E402

TOL = dict(atol=1e-10, rtol=1e-9)  # float64


def _pair(order: str, cfg: condcomp.CondCompConfig) -> tuple[nn.Module, nn.Module]:
    """(PEFT reference, wrapped model with the same base and adapter weights)."""
    torch.manual_seed(0)
    base = build("gpt2")
    for d in base.modules():  # before wrapping (the adapter reads attn_dropout's p once): the gradient test trains,
        if isinstance(d, nn.Dropout):  # and two dropout draws would differ
            d.p = 0.0
    return lora_pair(base, order, cfg)


IDS = torch.randint(2, 100, (2, 6), generator=torch.Generator().manual_seed(3))


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["gathered", "masked"])
@pytest.mark.parametrize("order", ["lora_first", "condcomp_first"])
def test_full_budget_equals_the_peft_model_outputs_and_lora_gradients(order: str, executor: str) -> None:
    ref, model = _pair(order, condcomp.CondCompConfig(policy="full", router="random", executor=executor))
    for m in (ref, model):
        m.train()
        m(input_ids=IDS).logits.pow(2).mean().backward()
    ref.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, ref(input_ids=IDS).logits, **TOL)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n}
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert len(grads) == len(ref_grads) == 12  # 2 layers x (attn.c_attn, attn.c_proj, mlp.c_proj) x (A, B)
    for name, g in grads.items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(g, ref_grads[name], **TOL)


def test_half_budget_equals_the_merged_peft_model(prefer_router: str) -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router, executor="gathered")
    ref, model = _pair("lora_first", cfg)
    merged = ref.merge_and_unload()  # plain Conv1D weights holding W + BA (PEFT's own transposition)
    condcomp.apply_(merged, cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, merged(input_ids=IDS).logits, **TOL)
