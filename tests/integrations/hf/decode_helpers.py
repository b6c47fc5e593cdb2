"""Tiny decoders and independent references for the KV-cache tests (nothing downloaded).

The reference for a per-request plan is the reference executor (per-head loop) run over the whole sequence in one
forward *without* a cache, with the plan decided from the prompt (``condcomp.plan_from_prompt``): it shares no code
with the cached path. At the full budget the reference is the unwrapped model itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import condcomp

t = pytest.importorskip("transformers")

P = 6  # prompt width (left-padded)
TOL = dict(atol=1e-4, rtol=1e-4)  # wrapped vs oracle logits (float32)
GREEDY = dict(do_sample=False, pad_token_id=0)


def llama(kv_heads: int = 2, seed: int = 0, **extra: object) -> nn.Module:
    torch.manual_seed(seed)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=kv_heads, vocab_size=97, max_position_embeddings=64, **extra)
    config._attn_implementation = "sdpa"
    return t.LlamaForCausalLM(config).eval()


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64)).eval()


def wrap(model: nn.Module, fraction: float = 0.5, policy: object = None, kv_groups: bool = True) -> nn.Module:
    router = ("topk", {"kv_groups": kv_groups}) if getattr(model.config, "num_key_value_heads", None) else "topk"
    cfg = condcomp.CondCompConfig(policy=policy or ("fixed", {"fraction": fraction}), router=router)
    condcomp.apply_(model, cfg)
    return model.eval()


def prompts(batch: int = 3, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (batch, P), generator=g)
    mask = torch.ones(batch, P, dtype=torch.long)
    if batch > 1:
        mask[1, :2] = 0  # left padding
    if batch > 2:
        mask[2, :4] = 0
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


@torch.no_grad()
def step(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, cache: object, new: int) -> torch.Tensor:
    """One forward of the last ``new`` tokens on ``cache`` (``mask`` covers every token so far); last logits."""
    out = model(input_ids=tokens[:, -new:], attention_mask=mask, position_ids=positions(mask)[:, -new:],
                past_key_values=cache, use_cache=True)
    return out.logits[:, -1]  # type: ignore[no-any-return]


def extend(tokens: torch.Tensor, mask: torch.Tensor, nxt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([tokens, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)


@torch.no_grad()
def reference_logits(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, prompt_len: int = P) -> torch.Tensor:
    """Logits at every position from one cache-free forward, reference executor, plans from ``prompt_len``."""
    ref = copy.deepcopy(model)
    for m in condcomp.api.routed_modules(ref).values():
        m.executor = "reference"
    full = torch.cat([mask, torch.ones(mask.shape[0], tokens.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with condcomp.plan_from_prompt(ref, prompt_len):
        out = ref(input_ids=tokens, attention_mask=full, position_ids=positions(full), use_cache=False)
    return out.logits  # type: ignore[no-any-return]


@torch.no_grad()
def reference_greedy(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int,
                     prompt_len: int | None = None) -> torch.Tensor:
    """Greedy decoding by cache-free reference forwards over everything so far (plans from the prompt)."""
    tokens = ids
    for _ in range(new):
        nxt = reference_logits(model, tokens, mask, prompt_len or ids.shape[1])[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
    return tokens


def rows_differ(model: nn.Module, cache: object) -> bool:
    """Whether some layer's rows keep different heads (so a row mix-up would show)."""
    plans = condcomp.request_plans(model, cache)
    return any(len({tuple(r) for r in p.kept_heads()}) > 1 for p in plans.values())
