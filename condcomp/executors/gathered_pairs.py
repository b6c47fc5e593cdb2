"""The gathered executor's packed-pairs path for sequence plans whose examples use different numbers of heads.

Every selected (example, head) pair is one batch entry: its input rows and its head's fused q/k/v weight slice
are gathered, and the projections and attention run as one ``baddbmm`` and one
SDPA call over ``(P, 1, T, Dh)``. The output projection puts each example's heads side by side in ``max_k`` slots
and runs one ``bmm`` per example (zero slots waste at most ``PAD_LIMIT`` times the needed work), or past that
bound one ``bmm`` per pair summed into the examples with ``scatter_add_``. The number of
kernels is the same whatever the spread of k (bucketing by k repeats the whole block per bucket, which costs a
scheduling round per kernel on a loaded CPU); the price is ``P * T * D`` extra memory traffic for the gathered
inputs and the per-pair outputs, with no padding (P is the exact number of selected pairs).
Used for self-attention without GQA or a KV cache (the fused layout); other sequence calls use the buckets.

:func:`sequence_pairs_grouped` is the same packing without the copies: on CPU (MKL's batch GEMM), each pair's
projections read its example's input rows and its head's weights in place and each pair's output projection adds
into its example's rows. It is the default there (float32/float64, no autocast) for every plan with different
head sets, and for one-k plans whose single bucket would copy at least ``gathered.MIN_GROUPED_COPY`` weight
floats; the copying version above stays for other devices when ``PACK_PAIRS`` is set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.executors.base import per_head, qkv_head_rows, zero_dead_rows
from condcomp.executors.grouped_gemm import pair_output, pair_projection
from condcomp.masks import AttentionMask, apply_rotary, dead_rows
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

# The output projection pads each example to the largest k in the batch (one bmm with K = max_k * Dh, efficient)
# while that computes at most this many times the selected pairs; past it, one bmm per pair and a scatter-add.
PAD_LIMIT = 2.0


def sequence_pairs(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, mask: AttentionMask,
                   pairs: int, max_k: int) -> Tensor:
    """``(B, T, D)`` of a sequence plan with ``pairs`` selected (example, head) pairs in total."""
    x = inputs.x
    B, T, D_in = x.shape
    L = w.layout
    H, Dh = L.num_heads, L.head_dim
    # Pair ids b * H + h of the active pairs, ascending, without a second host read (pairs is known).
    pid = torch.argsort((~plan.active.reshape(-1)).byte(), stable=True)[:pairs]  # (P,)
    b_idx = torch.div(pid, H, rounding_mode="floor")
    h_idx = pid - b_idx * H
    xp = x[b_idx]  # (P, T, D_in)
    # Rows of head h in the (3H, Dh * D_in) q/k/v head blocks: h, H + h, 2H + h (small memcpy slices).
    rows = torch.stack([h_idx, h_idx + H, h_idx + 2 * H], 1).reshape(-1)  # (3P,)
    wqkv, bqkv = qkv_head_rows(w)  # (3H, Dh * D_in), (3H, Dh) or None
    wp = wqkv.index_select(0, rows).view(pairs, 3 * Dh, D_in)  # (P, 3Dh, D_in)
    if bqkv is not None:
        qkv = torch.baddbmm(bqkv.index_select(0, rows).view(pairs, 1, 3 * Dh), xp, wp.transpose(1, 2))
    else:
        qkv = torch.bmm(xp, wp.transpose(1, 2))  # (P, T, 3Dh)
    q, k, v = qkv.view(pairs, T, 3, Dh).permute(2, 0, 1, 3).unsqueeze(2).unbind(0)  # each (P, 1, T, Dh)
    if inputs.rotary is not None:
        cos, sin = (t[b_idx] for t in inputs.rotary)  # (P, T, Dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    m = mask.for_rows(b_idx, h_idx)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.mask, dropout_p=inputs.dropout_p,
                                         is_causal=m.is_causal, scale=L.scale)  # (P, 1, T, Dh)
    if m.dead is not None:
        out = out.masked_fill(m.dead.unsqueeze(-1), 0.0)
    out = out.view(pairs, T, Dh) * plan.gates[b_idx, h_idx].to(out.dtype)[:, None, None]
    if B * max_k <= PAD_LIMIT * pairs:
        y = _output_per_example(w, plan, out, b_idx, h_idx, max_k)
    else:
        y = _output_per_pair(w, plan, out, b_idx, h_idx)
    return zero_dead_rows(y.to(x.dtype), dead_rows(mask, B, T))


def _bias_rows(w: AttentionWeights, plan: HeadPlan, dtype: torch.dtype) -> Tensor | None:
    """``(B, 1, D)``: the output bias on examples with at least one head, zero on the others."""
    if w.o_bias is None:
        return None
    return (w.o_bias.to(dtype) * (plan.counts > 0).to(dtype)[:, None])[:, None, :]


def _output_per_example(w: AttentionWeights, plan: HeadPlan, out: Tensor, b_idx: Tensor, h_idx: Tensor,
                        max_k: int) -> Tensor:
    """Each example's heads side by side in ``max_k`` slots (zero-padded), one ``bmm`` with K = max_k * Dh."""
    P, T, Dh = out.shape
    B, H = plan.active.shape
    D = w.o_weight.shape[0]
    slot = torch.cumsum(plan.active.long(), 1) - 1  # (B, H): position of each active head in its example
    buf = out.new_zeros(B, T, max_k, Dh)
    buf[b_idx, :, slot[b_idx, h_idx]] = out  # (B, T, max_k, Dh); empty slots stay zero
    wo = w.o_weight.view(D, H, Dh).permute(1, 2, 0)  # (H, Dh, D)
    wo = torch.cat([wo, wo.new_zeros(1, Dh, D)])  # head H: the zero weights of an empty slot
    j = torch.arange(max_k, device=out.device)
    heads = torch.where(j < plan.counts[:, None], plan.order[:, :max_k], H)  # (B, max_k)
    wo_b = wo[heads].view(B, max_k * Dh, D)
    bias = _bias_rows(w, plan, out.dtype)
    inp = buf.view(B, T, max_k * Dh)
    return torch.bmm(inp, wo_b) if bias is None else torch.baddbmm(bias, inp, wo_b)  # (B, T, D)


def _output_per_pair(w: AttentionWeights, plan: HeadPlan, out: Tensor, b_idx: Tensor, h_idx: Tensor) -> Tensor:
    """One ``(T, Dh) @ (Dh, D)`` per pair, summed into the examples with ``scatter_add_`` (no padding)."""
    P, T, Dh = out.shape
    B, H = plan.active.shape
    D = w.o_weight.shape[0]
    wo = w.o_weight.view(D, H, Dh).permute(1, 2, 0).reshape(H, Dh * D)  # (H, Dh*D): head h's output rows
    yp = torch.bmm(out, wo.index_select(0, h_idx).view(P, Dh, D))  # (P, T, D)
    bias = _bias_rows(w, plan, yp.dtype)
    y = yp.new_zeros(B, T, D) if bias is None else bias.expand(B, T, D).contiguous()
    return y.scatter_add_(0, b_idx[:, None, None].expand(P, T, D), yp)  # (B, T, D)


@torch.compiler.disable  # ctypes calls on raw pointers cannot be traced: one graph break, this part runs eagerly
def sequence_pairs_grouped(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, mask: AttentionMask,
                           pairs: int) -> Tensor:
    """``(B, T, D)`` through grouped GEMMs (CPU, MKL; grouped_gemm.py): every selected (example, head) pair's
    projections read its input rows and its head's weight block in place, one SDPA call covers all pairs, and each
    pair's output projection adds into its example's output rows. No input row, weight slice or output is copied,
    and there is no padding: the work is the selected pairs' and nothing else. With GQA, keys and values are
    projected once per (example, key/value head) that some selected head of the example reads."""
    x = inputs.x
    B, T, D_in = x.shape
    L = w.layout
    H, Dh = L.num_heads, L.head_dim
    pid = plan.active.reshape(-1).nonzero().squeeze(1)  # (P,) b * H + h, ascending (CPU: no synchronisation)
    b_idx = torch.div(pid, H, rounding_mode="floor")
    h_idx = pid - b_idx * H
    fresh_kv = inputs.key_states is None or inputs.value_states is None
    if inputs.key is None and inputs.value is None and fresh_kv and L.group_size == 1:  # the fused layout
        rows, b3 = qkv_head_rows(w)  # (3H, Dh * D_in), (3H, Dh) or None
        # head-major (H, 3*Dh, D_in): one GEMM per pair gives its q, k and v (one copy of the 3*D*D weights)
        w_heads = rows.view(3, H, Dh * D_in).transpose(0, 1).reshape(H, 3 * Dh, D_in)
        b_heads = None if b3 is None else b3.view(3, H, Dh).transpose(0, 1).reshape(H, 3 * Dh)
        qkv = pair_projection(x, w_heads, b_heads, b_idx, h_idx)  # (P, T, 3Dh)
        q, k, v = qkv.view(pairs, T, 3, Dh).permute(2, 0, 1, 3).unsqueeze(2).unbind(0)  # each (P, 1, T, Dh)
    else:
        q = pair_projection(x, per_head(w.q_weight, H, Dh), _bias_per_head(w.q_bias, H, Dh), b_idx, h_idx)
        q = q.unsqueeze(1)  # (P, 1, T, Dh)
        k, v = _pair_keys_values(w, inputs, b_idx, h_idx)  # each (P, 1, S, Dh), rotary not yet applied
    if inputs.rotary is not None:
        cos, sin = (t.index_select(0, b_idx) for t in inputs.rotary)  # (P, T, Dh)
        q = apply_rotary(q, cos, sin)
        if fresh_kv:  # a cache holds keys already rotated
            k = apply_rotary(k, cos, sin)
    m = mask.for_rows(b_idx, h_idx)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.mask, dropout_p=inputs.dropout_p,
                                         is_causal=m.is_causal, scale=L.scale)  # (P, 1, T, Dh)
    if m.dead is not None:
        out = out.masked_fill(m.dead.unsqueeze(-1), 0.0)
    gates = plan.gates.reshape(-1).index_select(0, pid).to(out.dtype)[:, None, None]  # (P, 1, 1)
    if torch.is_grad_enabled() and (out.requires_grad or gates.requires_grad):
        out = out.reshape(pairs, T, Dh) * gates
    else:  # inference: scale in place, no second (P, T, Dh) buffer
        out = out.reshape(pairs, T, Dh).mul_(gates)
    base = _bias_rows(w, plan, out.dtype)  # (B, 1, D): the bias on examples with a head
    base = (out.new_zeros(()) if base is None else base).expand(B, T, w.o_weight.shape[0])
    y = pair_output(out, w.o_weight, base, b_idx, h_idx)
    return zero_dead_rows(y, dead_rows(mask, B, T))


def _bias_per_head(b: Tensor | None, n_heads: int, head_dim: int) -> Tensor | None:
    """A ``(n_heads * Dh,)`` projection bias as ``(n_heads, Dh)``; a missing bias stays None."""
    return None if b is None else per_head(b, n_heads, head_dim)


def _pair_keys_values(w: AttentionWeights, inputs: AttentionInputs, b_idx: Tensor,
                      h_idx: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values ``(P, 1, S, Dh)`` of each pair's key/value head: read from the KV cache, or projected once
    per distinct (example, key/value head) and, with GQA, repeated for the query heads that share it."""
    L = w.layout
    Hkv, Dh = L.num_kv_heads, L.head_dim
    g_idx = torch.div(h_idx, L.group_size, rounding_mode="floor")  # (P,) each pair's key/value head
    if inputs.key_states is not None and inputs.value_states is not None:
        return inputs.key_states[b_idx, g_idx].unsqueeze(1), inputs.value_states[b_idx, g_idx].unsqueeze(1)
    # pairs are sorted by example, then head, so their (example, key/value head) ids are non-decreasing
    kv_ids, which = torch.unique_consecutive(b_idx * Hkv + g_idx, return_inverse=True)  # (Pkv,), (P,)
    kb, kg = torch.div(kv_ids, Hkv, rounding_mode="floor"), kv_ids % Hkv
    wk, wv = per_head(w.k_weight, Hkv, Dh), per_head(w.v_weight, Hkv, Dh)  # (Hkv, Dh, Dk), (Hkv, Dh, Dv)
    if inputs.key_input is inputs.value_input:  # one GEMM per (example, kv head) for both: (Hkv, 2*Dh, Dk)
        bk, bv = _bias_per_head(w.k_bias, Hkv, Dh), _bias_per_head(w.v_bias, Hkv, Dh)
        bias = None
        if bk is not None or bv is not None:  # a missing bias (e.g. no key bias) is zeros
            bias = torch.cat([wk.new_zeros(Hkv, Dh) if b is None else b for b in (bk, bv)], 1)
        kv = pair_projection(inputs.key_input, torch.cat([wk, wv], 1), bias, kb, kg)  # (Pkv, S, 2*Dh)
        k, v = kv.split(Dh, -1)
    else:
        k = pair_projection(inputs.key_input, wk, _bias_per_head(w.k_bias, Hkv, Dh), kb, kg)  # (Pkv, S, Dh)
        v = pair_projection(inputs.value_input, wv, _bias_per_head(w.v_bias, Hkv, Dh), kb, kg)
    if kv_ids.numel() < b_idx.numel():  # GQA: query heads of one example that share a key/value head
        k, v = k.index_select(0, which), v.index_select(0, which)
    return k.unsqueeze(1), v.unsqueeze(1)
