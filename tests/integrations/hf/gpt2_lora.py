"""PEFT LoRA on GPT-2's Conv1D projections for the LoRA tests: the adapter config, and a (PEFT reference, wrapped
model) pair with the same base and adapter weights, in either order of ``apply_`` and ``get_peft_model``."""

from __future__ import annotations

import copy

import torch
from torch import nn

import condcomp


def gpt2_lora(model: nn.Module) -> nn.Module:
    import peft

    # init_lora_weights=False: B is random too, so the adapters change the output from the start
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                          init_lora_weights=False, lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


def lora_pair(base: nn.Module, order: str, cfg: condcomp.CondCompConfig) -> tuple[nn.Module, nn.Module]:
    """(PEFT reference, wrapped model); ``order``: ``lora_first`` (LoRA, then ``apply_``) or ``condcomp_first``."""
    torch.manual_seed(0)
    ref = gpt2_lora(copy.deepcopy(base))  # the PEFT model: its adapter weights are the test's
    if order == "lora_first":
        model = gpt2_lora(copy.deepcopy(base))
        model.load_state_dict(ref.state_dict())
        condcomp.apply_(model, cfg)
    else:
        model = copy.deepcopy(base)
        condcomp.apply_(model, cfg)
        model = gpt2_lora(model)
        model.load_state_dict(ref.state_dict(), strict=False)  # the wrapped model adds its routing state
    return ref, model
