"""PEFT LoRA on GPT-2's fused ``c_attn`` (and ``c_proj``) under a KV policy that keeps a state of its own
(``window``): the compact cache projects through the LoRA layers' own forward.

Oracle: the streaming rule written from scratch in float64 (family_oracles.window_rule_logits) on PEFT's merged
model (plain Conv1D weights holding W + BA), with the plans the LoRA model's requests hold. Greedy ``generate`` of
the wrapped LoRA model picks, at every step, the rule's argmax given the same prefix, and its logits equal the
rule's; both orders of ``apply_`` and ``get_peft_model``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from decode_helpers import GREEDY, TOL, P, prompts
from family_oracles import gpt2, window_rule_logits
from gpt2_lora import lora_pair

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")

SINKS, WINDOW, NEW = 1, 3, 4
CFG = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk",
                              kv=("window", {"sinks": SINKS, "window": WINDOW}))


@pytest.mark.parametrize("order", ["lora_first", "condcomp_first"])
def test_generate_with_lora_on_c_attn_under_a_window_policy_equals_the_rule_on_the_merged_model(order: str) -> None:
    torch.manual_seed(0)
    ref, model = lora_pair(gpt2(), order, CFG)
    model.eval()
    assert any("lora_A" in n and "c_attn" in n for n, _ in model.named_parameters())
    ids, mask = prompts()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True,
                             return_dict_in_generate=True, **GREEDY)
    tokens = out.sequences  # (B, P + NEW)
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], NEW, dtype=mask.dtype)], 1)
    plans = {name.removeprefix("base_model.model."): plan
             for name, plan in condcomp.request_plans(model, out.past_key_values).items()}
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == {"full", "window"}
    merged = copy.deepcopy(ref).merge_and_unload()  # W + BA in plain Conv1D weights
    condcomp.apply_(merged, CFG)  # only for the rule to find the layers it replaces
    want = window_rule_logits(merged, "gpt2", plans, tokens, full_mask, SINKS, WINDOW)  # (B, P + NEW, V) float64
    got = torch.stack(out.logits, 1)  # (B, NEW, V)
    torch.testing.assert_close(got.double(), want[:, P - 1:-1], **TOL)
    assert torch.equal(tokens[:, P:], want[:, P - 1:-1].argmax(-1))  # each generated token: the rule's argmax
