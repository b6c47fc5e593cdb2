"""Sequence-plan strategies (one head set per example, variable ``k``), tried in this order (strategies.py):

1. ``sequence.shared_set``: every example chose the same heads: one plain k-head block on those heads' weights.
2. ``sequence.grouped``: CPU, float32/float64, MKL: grouped GEMMs over the selected (example, head) pairs read
   input rows and weight blocks in place (no copies, no padding; sequence_grouped.py). A plan whose examples all
   use the same ``k`` keeps strategy 3 while its weight copy is below ``tuning.min_grouped_copy``.
3. ``sequence.one_bucket``: every example uses the same ``(k, k_kv)``: one batched block over the whole batch.
4. ``sequence.buckets``: examples are bucketed by ``(k, k_kv)`` (active query heads, key/value heads they use);
   each bucket gathers its examples' input rows and heads' weight slices and runs as batched matmuls and one SDPA
   call over ``(n, k, T, Dh)``; each example's output row lands in place with ``index_copy_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from condcomp.executors import grouped_gemm
from condcomp.executors.base import keep_gates_in_graph, per_head, qkv_head_rows, zero_dead_rows
from condcomp.executors.gathered.blocks import batched_project, heads_block, project_heads, take
from condcomp.executors.gathered.call import GatheredCall, Strategy
from condcomp.executors.gathered.sequence_grouped import sequence_pairs_grouped
from condcomp.masks import AttentionMask, dead_rows
from condcomp.plans import kv_groups_used
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


def fused_layout(call: GatheredCall) -> bool:
    """Self-attention without GQA or a KV cache: q/k/v can be one ``(n, T, 3kDh)`` matmul."""
    i = call.inputs
    return i.key is None and i.value is None and i.key_states is None and call.weights.layout.group_size == 1


def bucket_mask(mask: AttentionMask, idx: Tensor | None, heads: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The attention mask ``(n|1, k|1, T, S)`` and dead rows ``(n|1, k|1, T)`` of a bucket's examples."""

    def rows(t: Tensor) -> Tensor:
        if t.shape[0] > 1 and idx is not None:
            t = t.index_select(0, idx)
        if t.shape[1] > 1:  # per-head mask: pick the selected heads of each example
            b = torch.arange(t.shape[0], device=t.device).unsqueeze(1)  # (n, 1)
            t = t[b, heads]
        return t

    m = None if mask.mask is None else rows(mask.mask)
    dead = None if mask.dead is None else rows(mask.dead)
    return m, dead


def bucket_block(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, mask: AttentionMask,
            idx: Tensor | None, k: int, kkv: int, fused_w: tuple[Tensor, Tensor | None] | None) -> Tensor:
    """Output ``(n, T, D)`` (output bias included) of the examples ``idx`` (None = all) that use ``k`` heads."""
    L = w.layout
    H, Hkv, Dh, G = L.num_heads, L.num_kv_heads, L.head_dim, L.group_size

    def pick(t: Tensor) -> Tensor:
        # index_select copies whole contiguous rows; advanced indexing (t[idx]) was 3-6x slower here
        return t if idx is None else t.index_select(0, idx)

    heads = pick(plan.order)[:, :k]  # (n, k) selected heads, ascending
    flat_heads = heads.reshape(-1)  # (n*k,)
    gates = pick(plan.gates).gather(1, heads)  # (n, k)
    x = pick(inputs.x)  # (n, T, D)
    n, T, _ = x.shape
    if fused_w is not None:  # self-attention without GQA: one (n, T, 3kDh) matmul, as nn.MultiheadAttention does
        rows, b3 = fused_w  # (3H, Dh*D) q, k, v head blocks and their biases (3H, Dh)
        qkv_ix = (flat_heads.unsqueeze(1) + torch.arange(0, 3 * H, H, device=x.device)).reshape(-1)  # (3nk,)
        bias = None if b3 is None else b3.index_select(0, qkv_ix).view(n, k * 3 * Dh)
        qkv = batched_project(x, rows.index_select(0, qkv_ix).view(n, k * 3 * Dh, -1), bias)  # (n, T, k*3*Dh)
        q, kk, v = qkv.view(n, T, k, 3, Dh).permute(3, 0, 2, 1, 4).unbind(0)  # each (n, k, T, Dh)
    else:
        q_bias = None if w.q_bias is None else w.q_bias.view(H, Dh).index_select(0, flat_heads).view(n, k * Dh)
        q = batched_project(x, per_head(w.q_weight, H, Dh).index_select(0, flat_heads).view(n, k * Dh, -1), q_bias)
        q = q.view(n, T, k, Dh).transpose(1, 2)  # (n, k, T, Dh)
        kv_heads = heads
        if G > 1:  # the key/value heads some selected query head reads, first, ascending
            kv_heads = pick(torch.argsort((~kv_groups_used(plan.active, Hkv)).byte(), dim=1, stable=True))
        kv_heads = kv_heads[:, :kkv]  # (n, kkv) the key/value heads this bucket needs, ascending
        if inputs.key_states is not None and inputs.value_states is not None:
            b = torch.arange(n, device=x.device).unsqueeze(1)
            kk, v = pick(inputs.key_states)[b, kv_heads], pick(inputs.value_states)[b, kv_heads]  # (n, kkv, S, Dh)
        else:
            flat_kv = kv_heads.reshape(-1)  # (n*kkv,)
            kk, v = (
                batched_project(pick(src), per_head(wt, Hkv, Dh).index_select(0, flat_kv).view(n, kkv * Dh, -1),
                                None if bt is None else bt.view(Hkv, Dh).index_select(0, flat_kv).view(n, kkv * Dh))
                .view(n, -1, kkv, Dh).transpose(1, 2)  # (n, kkv, S, Dh)
                for src, wt, bt in ((inputs.key_input, w.k_weight, w.k_bias),
                                    (inputs.value_input, w.v_weight, w.v_bias))
            )
    q = w.norm_queries(q)
    if inputs.key_states is None:
        kk = w.norm_keys(kk)
    if inputs.rotary is not None:
        cos, sin = (pick(t) for t in inputs.rotary)  # (n, T, Dh)
        q = apply_rotary(q, cos, sin)
        if inputs.key_states is None:
            kk = apply_rotary(kk, cos, sin)
    if fused_w is None and G > 1:  # each query head reads its key/value head's slot among the kkv computed ones
        slot = (torch.cumsum(kv_groups_used(plan.active, Hkv).long(), 1) - 1)  # (B, Hkv)
        slot = pick(slot).gather(1, torch.div(heads, G, rounding_mode="floor"))  # (n, k)
        ix = slot[:, :, None, None].expand(n, k, kk.shape[2], Dh)
        kk, v = kk.gather(1, ix), v.gather(1, ix)  # (n, k, S, Dh)
    attn_mask, dead = bucket_mask(mask, idx, heads)
    out = F.scaled_dot_product_attention(
        q, kk, v, attn_mask=attn_mask, dropout_p=inputs.dropout_p, is_causal=mask.is_causal, scale=L.scale
    )  # (n, k, T, Dh)
    if dead is not None:
        out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    out = out * gates.to(out.dtype)[:, :, None, None]
    out = out.transpose(1, 2).reshape(n, T, k * Dh)  # (n, T, k*Dh)
    # (n, k*Dh, D) as a transposed view: gathering columns of o_weight (D, H*Dh) keeps the copy row-contiguous
    wo = w.o_weight.view(-1, H, Dh).index_select(1, flat_heads).view(-1, n, k * Dh).permute(1, 2, 0)
    if w.o_bias is None:
        return torch.bmm(out, wo)  # (n, T, D)
    return torch.baddbmm(w.o_bias.expand(n, 1, -1), out, wo)  # every row of a k > 0 bucket gets the bias


def _finish(call: GatheredCall, y: Tensor) -> Tensor:
    B, T, _ = call.inputs.x.shape
    return zero_dead_rows(y, dead_rows(call.mask, B, T))


class SharedSet(Strategy):
    name, granularity = "sequence.shared_set", "sequence"

    @override
    def supports(self, call: GatheredCall) -> list[str]:
        shared = call.sizes.shared_heads
        if shared is None:
            return ["the examples chose different head sets"]
        return [] if shared else ["no example chose a head"]

    @override
    def run(self, call: GatheredCall) -> Tensor:
        w, inputs, plan = call.weights, call.inputs, call.plan
        heads = list(call.sizes.shared_heads or ())
        G = w.layout.group_size
        kv_heads = sorted({h // G for h in heads})
        slot = {g: i for i, g in enumerate(kv_heads)}
        q, keys, values = project_heads(w, inputs, heads, kv_heads)  # (B, k, T, Dh), (B, kkv, S, Dh)
        kv_ix = [slot[h // G] for h in heads]
        gates = take(plan.gates, heads)[:, :, None, None]  # (B, k, 1, 1)
        y = heads_block(w, inputs, call.mask, heads, q, take(keys, kv_ix), take(values, kv_ix), gates, w.o_bias)
        return _finish(call, y)


def grouped_gemm_reasons(call: GatheredCall) -> list[str]:
    """Why grouped GEMMs cannot run this call: they need CPU, float32/float64 (MKL's batch GEMMs), no autocast,
    and every input, cache and weight in the query input's dtype and device."""
    x, w, i = call.inputs.x, call.weights, call.inputs
    if not call.tuning.grouped_gemm:
        return ["tuning.grouped_gemm is off"]
    reason = grouped_gemm.unavailable_reason(x)
    if reason:
        return [reason]
    reasons = []
    if torch.is_autocast_enabled(x.device.type):
        reasons.append("autocast is on")
    tensors = [i.key, i.value, i.key_states, i.value_states, w.q_weight, w.k_weight, w.v_weight, w.o_weight]
    if not all(t.dtype == x.dtype and t.device == x.device for t in tensors if t is not None):
        reasons.append("inputs, cache and weights differ in dtype or device")
    return reasons


class Grouped(Strategy):
    name, granularity = "sequence.grouped", "sequence"

    @override
    def supports(self, call: GatheredCall) -> list[str]:
        if call.pairs == 0:
            return ["no (example, head) pair is selected"]
        reasons = grouped_gemm_reasons(call)
        buckets = call.sizes.buckets
        if len(buckets) == 1:  # one shape of work: the batched block wins unless its weight copy is large
            copied = call.pairs * 3 * call.weights.layout.head_dim * call.inputs.x.shape[-1]
            if copied < call.tuning.min_grouped_copy:
                reasons.append(f"one bucket (k = {buckets[0][0]}) whose block copies {copied:,} weight floats, "
                               f"below tuning.min_grouped_copy = {call.tuning.min_grouped_copy:,}")
        return reasons

    @override
    def run(self, call: GatheredCall) -> Tensor:
        return sequence_pairs_grouped(call.weights, call.inputs, call.plan, call.mask, call.pairs)


class OneBucket(Strategy):
    name, granularity = "sequence.one_bucket", "sequence"

    @override
    def supports(self, call: GatheredCall) -> list[str]:
        buckets = call.sizes.buckets
        if len(buckets) != 1:
            return [f"{len(buckets)} buckets of (k, k_kv)"]
        return [] if buckets[0][0] > 0 else ["every example has k = 0"]

    @override
    def run(self, call: GatheredCall) -> Tensor:
        k, kkv, _ = call.sizes.buckets[0]
        fused_w = qkv_head_rows(call.weights) if fused_layout(call) else None
        return _finish(call, bucket_block(call.weights, call.inputs, call.plan, call.mask, None, k, kkv, fused_w))


class Buckets(Strategy):
    name, granularity = "sequence.buckets", "sequence"

    @override
    def run(self, call: GatheredCall) -> Tensor:
        w, inputs, plan = call.weights, call.inputs, call.plan
        x = inputs.x
        B, T, _ = x.shape
        D, Hkv = w.o_weight.shape[0], w.layout.num_kv_heads
        fused_w = qkv_head_rows(w) if fused_layout(call) else None
        key = plan.counts.long() * (Hkv + 1)
        key = key + (kv_groups_used(plan.active, Hkv).sum(-1) if w.layout.group_size > 1 else plan.counts.long())
        perm = torch.argsort(key, stable=True)  # (B,) examples sorted by bucket
        buckets = call.sizes.buckets
        y = x.new_zeros(B, T, D) if buckets and buckets[0][0] == 0 else x.new_empty(B, T, D)
        start = 0
        for k, kkv, n in buckets:
            idx = perm[start:start + n]
            start += n
            if k > 0:  # rows of k = 0 examples stay exactly zero (no bias either)
                part = bucket_block(w, inputs, plan, call.mask, idx, k, kkv, fused_w)  # autocast: maybe bf16
                y.index_copy_(0, idx, part.to(y.dtype))
        return _finish(call, keep_gates_in_graph(y, plan))  # every k = 0: zero output, still in the graph
