"""Tiny GPT-2, BERT-as-decoder and T5 models and two oracles for their compact KV caches (not a test module).

- :func:`gated_unwrapped`: the *unwrapped* model with each wrapped layer's head outputs scaled by the request's
  gates (0 for the heads a plan drops), per row, by a pre-hook on the output projection: the oracle of ``drop``
  and ``full`` (where the groups a plan does not keep compute at gate 1).
- :func:`window_rule_logits`: the streaming rule written from scratch in float64, key by key, for GPT-2 and BERT
  (absolute positions, scores scaled by 1/sqrt(Dh)): a streamed group's heads read only the first ``sinks`` and the
  last ``window`` real tokens.

Neither shares code with the cached path; the plans they read are the requests' (``condcomp.request_plans``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from decode_helpers import positions
from torch import Tensor, nn

import condcomp
from condcomp.kv.selection import KV_WINDOW, RequestPlan

t = pytest.importorskip("transformers")

T5_DECODER_SELF = r"re:decoder\.block\.\d+\.layer\.0\.SelfAttention"  # T5's decoder self-attention layers
OUTPUT_PROJECTION = {"gpt2": "c_proj", "bert": "output.dense", "t5": "o"}  # below each wrapped attention module


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64)
    config._attn_implementation = "sdpa"
    return t.GPT2LMHeadModel(config).eval()


def bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                          vocab_size=97, max_position_embeddings=64, is_decoder=True)
    config._attn_implementation = "sdpa"
    return t.BertLMHeadModel(config).eval()


def t5(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = t.T5Config(d_model=64, d_kv=16, d_ff=37, num_layers=2, num_heads=4, vocab_size=97,
                        decoder_start_token_id=0, relative_attention_num_buckets=8,
                        relative_attention_max_distance=6)
    config._attn_implementation = "sdpa"
    return t.T5ForConditionalGeneration(config).eval()


def new_cache(family: str) -> Any:
    """An empty cache of the kind the family's generate builds (BERT and T5: an ``EncoderDecoderCache``)."""
    return t.DynamicCache() if family == "gpt2" else t.EncoderDecoderCache(t.DynamicCache(), t.DynamicCache())


def head_factors(plan: RequestPlan, full_groups: bool) -> Tensor:
    """``(B, H)``: each head's factor on its output: its gate where the plan computes it, else 0 (``drop``) or 1
    (``full``: every head of a group the plan does not keep computes at gate 1)."""
    kept = plan.heads & (plan.gates != 0)
    rest = torch.ones_like(plan.gates) if full_groups else torch.zeros_like(plan.gates)
    return torch.where(kept, plan.gates, rest)


def gated_unwrapped(model: nn.Module, family: str, plans: dict[str, RequestPlan], full_groups: bool = False
                    ) -> nn.Module:
    """A copy of ``model`` unwrapped, each planned layer's head outputs ``(B, T, H*Dh)`` scaled per row by
    :func:`head_factors` before its output projection. Rows repeated for beams (``B * n``) repeat their plan."""
    ref = copy.deepcopy(model)
    condcomp.remove_(ref)
    for name, plan in plans.items():
        factors = head_factors(plan, full_groups)  # (B, H)

        def scale(_: nn.Module, args: tuple[Tensor, ...], _f: Tensor = factors) -> tuple[Tensor, ...]:
            (y,) = args  # (B', T, H*Dh)
            f = _f.repeat_interleave(y.shape[0] // _f.shape[0], 0)  # (B', H)
            return (y * f.repeat_interleave(y.shape[-1] // f.shape[1], 1)[:, None, :].to(y.dtype),)

        ref.get_submodule(f"{name}.{OUTPUT_PROJECTION[family]}").register_forward_pre_hook(scale)
    return ref


def rule_attention(q: Tensor, k: Tensor, v: Tensor, plan: RequestPlan, mask: Tensor, sinks: int, window: int
                   ) -> Tensor:
    """``q, k, v (B, H, T, Dh)`` (MHA) -> the heads' outputs ``(B, T, H*Dh)`` under the rule: causal over real
    tokens; a streamed group's heads only within the sinks or the recent window; skipped heads give zero."""
    B, H, T, Dh = q.shape
    pos = (mask.long().cumsum(-1) - 1).tolist()
    out = torch.zeros(B, H, T, Dh, dtype=q.dtype)
    assert plan.kv_modes is not None
    for b in range(B):
        for h in range(H):
            gate = float(plan.gates[b, h]) if bool(plan.heads[b, h]) else 0.0
            streamed = int(plan.kv_modes[b, h]) == KV_WINDOW
            for i in range(T):
                if not mask[b, i] or gate == 0.0:
                    continue
                p = pos[b][i]
                keys = [j for j in range(i + 1) if mask[b, j]
                        and (not streamed or pos[b][j] < sinks or p - pos[b][j] < window)]
                scores = (k[b, h, keys] @ q[b, h, i]) * Dh**-0.5
                out[b, h, i] = gate * (scores.softmax(-1) @ v[b, h, keys])
    return out.transpose(1, 2).reshape(B, T, H * Dh)


def _heads(t_: Tensor, H: int) -> Tensor:
    B, T, D = t_.shape
    return t_.view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, Dh)


def _rule_forward(family: str, routed: Any, plan: RequestPlan, mask: Tensor, sinks: int, window: int
                  ) -> Callable[..., tuple[Tensor, None]]:
    H = plan.heads.shape[1]

    def forward(hidden_states: Tensor, *_: Any, **__: Any) -> tuple[Tensor, None]:
        x = hidden_states
        if family == "gpt2":
            q, k, v = routed.c_attn(x).split(x.shape[-1], dim=-1)
            out = rule_attention(_heads(q, H), _heads(k, H), _heads(v, H), plan, mask, sinks, window)
            return routed.c_proj(out), None
        core = routed.self  # BERT: query/key/value, then dense -> LayerNorm(. + residual)
        out = rule_attention(_heads(core.query(x), H), _heads(core.key(x), H), _heads(core.value(x), H), plan, mask,
                             sinks, window)
        return routed.output.LayerNorm(routed.output.dense(out) + x), None

    return forward


@torch.no_grad()
def window_rule_logits(model: nn.Module, family: str, plans: dict[str, RequestPlan], tokens: Tensor, mask: Tensor,
                       sinks: int, window: int) -> Tensor:
    """``(B, S, V)`` float64 logits of ``tokens`` (one forward, no cache) under each layer's request plan."""
    ref = copy.deepcopy(model).double()
    for name, routed in condcomp.api.routed_modules(ref).items():
        routed.forward = _rule_forward(family, routed, plans[name], mask.bool(), sinks, window)
    return ref(input_ids=tokens, attention_mask=mask, position_ids=positions(mask),  # type: ignore[no-any-return]
               use_cache=False).logits
