"""The ``sequence.grouped`` strategy's computation: grouped GEMMs over the selected (example, head) pairs (CPU, MKL).

Every selected pair is one GEMM of a batch (:mod:`condcomp.executors.grouped_gemm`): its projections read its
example's input rows and its head's weight block in place, one SDPA call covers all pairs, and each pair's output
projection adds into its example's output rows. No input row, weight slice or output is copied, and there is no
padding: the work is the selected pairs' and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.executors.base import per_head, qkv_head_rows, zero_dead_rows
from condcomp.executors.grouped_gemm import pair_output, pair_projection
from condcomp.masks import AttentionMask, dead_rows
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


def _bias_rows(w: AttentionWeights, plan: HeadPlan, dtype: torch.dtype) -> Tensor | None:
    """``(B, 1, D)``: the output bias on examples with at least one head, zero on the others."""
    if w.o_bias is None:
        return None
    return (w.o_bias.to(dtype) * (plan.counts > 0).to(dtype)[:, None])[:, None, :]


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
    q = w.norm_queries(q)
    if fresh_kv:
        k = w.norm_keys(k)
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
