"""T5's decoder self-attention under a KV policy, written from scratch in float64: the oracle of test_t5_kv_policies.

Key by key, per row, head and query, over the whole sequence in one forward without a cache: T5's score (q.k, not
scaled) plus its relative position bias (the bucket of the distance from query to key, T5's bucketing rewritten
here, looked up in the first layer's ``relative_attention_bias``), over the keys the policy keeps:

- ``window``: a held group's heads read the first ``sinks`` and the last ``window`` real tokens;
- ``snapkv``: a held group keeps the ``budget`` prompt tokens the last ``observe`` prompt queries attend to most
  (their softmax with the bias, summed; average-pooled over ``pool`` tokens, zero padded) plus those ``observe``
  tokens; ``adakv``: the row's ``budget x held groups`` shared by score over its held groups, each first given its
  ``floor`` share of its own best. After the prompt its heads read the kept prompt tokens and every later token.

It shares no code with the cached path; the plans it reads are the requests' (``condcomp.request_plans``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor, nn

import condcomp
from condcomp.kv.selection import KV_WINDOW, RequestPlan


def bucket(distance: int, num_buckets: int, max_distance: int) -> int:
    """T5's decoder (unidirectional) bucket of a key ``distance >= 0`` tokens before its query."""
    exact = num_buckets // 2
    if distance < exact:
        return distance
    large = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(large, num_buckets - 1)


def scores_of(q: Tensor, k: Tensor, table: Tensor, config: Any, pos: list[int], i: int, keys: list[int]) -> Tensor:
    """One head's scores of query ``i`` over ``keys``: q.k plus the bias of each key's distance (real tokens)."""
    bias = [float(table[bucket(pos[i] - pos[j], config.relative_attention_num_buckets,
                               config.relative_attention_max_distance)]) for j in keys]
    return k[keys] @ q[i] + torch.tensor(bias, dtype=q.dtype)


def kept_prompt(kv: tuple[str, dict[str, Any]], q: Tensor, k: Tensor, tables: Tensor, config: Any, real: list[int],
                pos: list[int], groups: list[int]) -> dict[int, set[int]]:
    """Per held group (MHA: one head) of one row, the prompt tokens it keeps (sequence indices). ``q``/``k``
    ``(H, T, Dh)``, ``tables (H, buckets)``, ``real``: the row's real prompt indices."""
    name, opt = kv
    observe, pool, budget = opt["observe"], opt["pool"], opt["budget"]
    recent = real[len(real) - (opt.get("window") or observe):]
    scored = real[:len(real) - len(recent)]
    pooled: dict[int, dict[int, float]] = {}
    for g in groups:
        score = {j: 0.0 for j in scored}
        for i in real[-observe:]:
            seen = [j for j in real if j <= i]
            attn = scores_of(q[g], k[g], tables[g], config, pos, i, seen).softmax(-1)
            for j, a in zip(seen, attn.tolist()):
                if j in score:
                    score[j] += a
        half = pool // 2
        pooled[g] = {j: sum(score.get(j + d, 0.0) for d in range(-half, half + 1)) / pool for j in scored}
    if name == "snapkv":
        return {g: set(sorted(s, key=lambda j: -s[j])[:budget]) | set(recent) for g, s in pooled.items()}
    own = int(budget * opt.get("floor", 0.2))
    kept = {g: set(sorted(s, key=lambda j: -s[j])[:own]) for g, s in pooled.items()}
    left = budget * len(groups) - sum(len(v) for v in kept.values())
    rest = sorted(((s[j], g, j) for g, s in pooled.items() for j in s if j not in kept[g]), reverse=True)
    for _, g, j in rest[:left]:
        kept[g].add(j)
    return {g: kept[g] | set(recent) for g in groups}


def rule_attention(routed: Any, tables: Tensor, config: Any, plan: RequestPlan, kv: tuple[str, dict[str, Any]],
                   x: Tensor, mask: Tensor, prompt: int) -> Tensor:
    """One decoder self-attention layer's output ``(B, S, D)`` under the rule; ``mask (B, S)`` real tokens."""
    B, S, _ = x.shape
    H = plan.heads.shape[1]
    q, k, v = (proj(x).view(B, S, H, -1).transpose(1, 2) for proj in (routed.q, routed.k, routed.v))  # (B, H, S, Dh)
    out = torch.zeros_like(q)
    assert plan.kv_modes is not None
    for b in range(B):
        real = [j for j in range(S) if mask[b, j]]
        pos = [0] * S
        for n, j in enumerate(real):
            pos[j] = n
        held = [h for h in range(H) if int(plan.kv_modes[b, h]) == KV_WINDOW]
        kept = kept_prompt(kv, q[b], k[b], tables, config, [j for j in real if j < prompt], pos, held) if (
            kv[0] != "window" and held) else {}
        for h in range(H):
            gate = float(plan.gates[b, h]) if bool(plan.heads[b, h]) else 0.0
            for i in real:
                if gate == 0.0:
                    continue
                keys = [j for j in real if j <= i]
                if h in held and kv[0] == "window":
                    keys = [j for j in keys if pos[j] < kv[1]["sinks"] or pos[i] - pos[j] < kv[1]["window"]]
                elif h in held and i >= prompt:
                    keys = [j for j in keys if j >= prompt or j in kept[h]]
                attn = scores_of(q[b, h], k[b, h], tables[h], config, pos, i, keys).softmax(-1)
                out[b, h, i] = gate * (attn @ v[b, h, keys])
    return routed.o(out.transpose(1, 2).reshape(B, S, -1))  # type: ignore[no-any-return]


@torch.no_grad()
def t5_rule_logits(model: nn.Module, plans: dict[str, RequestPlan], kv: tuple[str, dict[str, Any]],
                   encoder: dict[str, Tensor], tokens: Tensor, mask: Tensor, prompt: int) -> Tensor:
    """``(B, S, V)`` float64 logits of the decoder ``tokens`` (``mask``: real tokens; the first ``prompt`` are
    the prompt) under each wrapped layer's request plan and the policy's rule."""
    ref = copy.deepcopy(model).double()
    routed_layers = condcomp.api.routed_modules(ref)
    first = ref.decoder.block[0].layer[0].SelfAttention  # the decoder's bias table: (buckets, H)
    tables = first.relative_attention_bias.weight.T  # (H, buckets)
    for name, routed in routed_layers.items():
        def forward(hidden_states: Tensor, *_: Any, _routed: Any = routed, _plan: RequestPlan = plans[name],
                    **__: Any) -> tuple[Tensor, Tensor, None]:
            y = rule_attention(_routed, tables, ref.config, _plan, kv, hidden_states, mask.bool(), prompt)
            S = hidden_states.shape[1]
            return y, hidden_states.new_zeros(1, tables.shape[0], S, S), None  # no later layer reads this bias

        routed.forward = forward
    return ref(**encoder, decoder_input_ids=tokens, decoder_attention_mask=mask,  # type: ignore[no-any-return]
               use_cache=False).logits
