"""The attention-function attachment on architectures the module swap has no adapter for: any module that dispatches
through transformers' ``AttentionInterface`` is routed. Reference: the unwrapped model (full budget, and with the
skipped heads' output columns zeroed where the output projection is a plain ``o_proj``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from integration_helpers import kept_heads, state_equal, zero_heads_
from torch import nn

import condcomp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
from condcomp.integrations.hf.interface import apply_interface_, remove_interface_  # noqa: E402

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=100)


def build(arch: str) -> nn.Module:
    t = transformers
    torch.manual_seed(0)
    if arch == "gpt2":
        model: nn.Module = t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                                          attn_implementation="sdpa"))
    elif arch == "distilbert":
        model = t.DistilBertModel(t.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=37, vocab_size=100,
                                                     attn_implementation="sdpa"))
    elif arch == "qwen3":
        model = t.Qwen3ForCausalLM(t.Qwen3Config(hidden_size=32, intermediate_size=37, num_key_value_heads=2,
                                                 head_dim=8, attn_implementation="sdpa", **SMALL))
    elif arch == "t5":
        model = t.T5EncoderModel(t.T5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=100,
                                            attn_implementation="sdpa"))
    else:
        raise ValueError(arch)
    return model.double().eval()


def run(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: Any = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ["gpt2", "distilbert", "qwen3", "t5"])
def test_any_interface_architecture_full_budget_half_budget_and_remove(arch: str, prefer_router: str) -> None:
    model = build(arch)
    ids, mask = _batch()
    want = run(model, ids, mask)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = apply_interface_(model, condcomp.CondCompConfig(policy="full", router="random"))
    assert len(names) == 2
    real = mask.bool()
    torch.testing.assert_close(run(model, ids, mask)[real], want[real], atol=1e-10, rtol=1e-9)
    remove_interface_(model)
    assert state_equal(model.state_dict(), before)
    for router in (prefer_router, ("norm", {})):  # the norm router reads the queries transformers projected
        apply_interface_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=router))
        half = run(model, ids, mask)
        usage = condcomp.head_usage(model)
        assert len(usage) == 2 and all(u.k_frac == 0.5 for u in usage.values())
        assert not torch.allclose(half[real], want[real])
        remove_interface_(model)
    torch.testing.assert_close(run(model, ids, mask), want, atol=0, rtol=0)


def test_half_budget_equals_the_unwrapped_model_without_the_skipped_heads(prefer_router: str) -> None:
    model = build("qwen3")
    ids, mask = _batch()
    names = apply_interface_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router))
    got = run(model, ids, mask)
    remove_interface_(model)
    ref = copy.deepcopy(model)
    for name in names:
        zero_heads_(ref.get_submodule(name).o_proj, kept_heads(4, 0.5), 8)
    real = mask.bool()
    torch.testing.assert_close(got[real], run(ref, ids, mask)[real], atol=1e-10, rtol=1e-9)
