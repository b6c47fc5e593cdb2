"""A model's own sliding window and a streamed group's window together (Mistral ``sliding_window``).

A streamed key/value group reads the first ``sinks`` tokens and the last ``window`` tokens of its request; on a model
that attends only the last ``sliding_window`` keys itself, it must read what *both* rules allow: never a key its
full group would not. The oracle is attention written here from scratch in float64 (per row, head and query: the
keys both rules allow, softmax, the plan's gate), run over the whole sequence without a cache; at the full budget
the oracle is the unwrapped model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decode_helpers import extend, prompts, step
from torch import nn
from window_rule import rule_logits

import condcomp

t = pytest.importorskip("transformers")

MODEL_WINDOW, SINKS, WINDOW, NEW = 3, 1, 6, 6  # the numbers: a streamed window wider than the model's


def mistral(seed: int = 0, family: str = "mistral") -> nn.Module:
    """A tiny random Mistral (``config.sliding_window``), or Qwen2 with every layer a sliding one."""
    torch.manual_seed(seed)
    size = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=97, max_position_embeddings=64, sliding_window=MODEL_WINDOW)
    if family == "qwen2":
        config = t.Qwen2Config(**size, use_sliding_window=True, max_window_layers=0)
        assert set(config.layer_types) == {"sliding_attention"}
    else:
        config = t.MistralConfig(**size)
    config._attn_implementation = "sdpa"
    return (t.Qwen2ForCausalLM if family == "qwen2" else t.MistralForCausalLM)(config).eval()


def streaming(model: nn.Module, fraction: float = 0.5) -> nn.Module:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}), router=("topk", {"kv_groups": True}),
                                  kv=("window", {"sinks": SINKS, "window": WINDOW}))
    condcomp.apply_(model, cfg)
    return model.eval()


@torch.no_grad()
def decode(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int
           ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], Any]:
    cache = t.DynamicCache(config=model.config)  # the model's own cache: sliding-window layers for the full groups
    logits = [step(model, ids, mask, cache, ids.shape[1])]
    tokens = ids
    for _ in range(new):
        tokens, mask = extend(tokens, mask, logits[-1].argmax(-1, keepdim=True))
        logits.append(step(model, tokens, mask, cache, 1))
    return tokens, mask, logits, cache


def long_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts longer than two streamed windows: the prefill is computed block by block (banded_attention)."""
    ids, mask = prompts()
    more = torch.randint(1, 97, (ids.shape[0], 7), generator=torch.Generator().manual_seed(5))
    return torch.cat([ids, more], 1), torch.cat([mask, torch.ones(mask.shape[0], 7, dtype=mask.dtype)], 1)


@pytest.mark.parametrize("family,long_prompt", [("mistral", False), ("mistral", True), ("qwen2", False)])
def test_streamed_groups_read_only_within_the_models_own_sliding_window(family: str, long_prompt: bool) -> None:
    model = streaming(mistral(family=family))
    ids, mask = long_prompts() if long_prompt else prompts()
    tokens, full_mask, logits, cache = decode(model, ids, mask, NEW)
    plans = condcomp.request_plans(model, cache)
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == {"full", "window"}
    ref = rule_logits(model, plans, tokens, full_mask, SINKS, WINDOW, MODEL_WINDOW)
    P = ids.shape[1]
    for i, got in enumerate(logits):
        torch.testing.assert_close(got.double(), ref[:, P - 1 + i], atol=1e-4, rtol=1e-4)


def test_full_groups_keep_the_models_own_window_at_the_full_budget() -> None:
    dense = mistral()
    model = streaming(mistral(), fraction=1.0)
    ids, mask = prompts()
    tokens, full_mask, logits, _ = decode(model, ids, mask, NEW)
    _, _, want, _ = decode(dense, ids, mask, NEW)
    for got, ref in zip(logits, want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_a_policy_with_a_state_of_its_own_that_cannot_apply_the_models_window_is_refused() -> None:
    model = mistral()
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"kv_groups": True}),
                                  kv=("snapkv", {"budget": 4, "observe": 2}))
    condcomp.apply_(model, cfg)
    ids, mask = prompts()
    with pytest.raises(ValueError, match="'snapkv'.*cannot apply this layer's own sliding window"):
        decode(model.eval(), ids, mask, 1)
