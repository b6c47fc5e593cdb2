"""The gathered executor's token path (MoH): queries, attention rows and output only for chosen (token, head) pairs.

Keys and values are computed for every key/value head that some token of the batch chose (a later token may
pick any head, so the whole sequence's keys are needed). Heads that (nearly) every token chose, such as MoH's
shared heads, run densely as one block. Each other head ``h`` packs, per example, the tokens that chose it into
``(B, L_h, D)``, where ``L_h`` is the largest such count over the batch; the padding is bounded by
``B * L_h - sum_b count_b(h)`` rows per head (the spread of per-example counts; its slots point at tokens whose
gate is zero, so they add exact zeros). The head's output rows are scattered back with ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.executors.base import add_output_bias, zero_dead_rows
from condcomp.executors.gathered import GatherSizes
from condcomp.masks import apply_rotary, build_attention_mask, causal_allowed, dead_rows
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

# A head chosen by at least this share of the (padded) query rows runs densely over all tokens: gathering
# would save less than it costs (measured on CPU, docs/performance.md).
DENSE_HEAD_ROWS = 0.8


def _rows(w: Tensor, heads: list[int], Dh: int) -> Tensor:
    """The ``Dh``-row blocks of ``heads`` of an ``(n * Dh, ...)`` weight or bias, concatenated."""
    return torch.cat([w[h * Dh:(h + 1) * Dh] for h in heads]) if heads else w[:0]


def _project_kv(w: AttentionWeights, inputs: AttentionInputs, kv_heads: list[int]) -> tuple[Tensor, Tensor]:
    """Keys and values ``(B, len(kv_heads), S, Dh)`` of the listed key/value heads only."""
    if inputs.key_states is not None and inputs.value_states is not None:
        return inputs.key_states[:, kv_heads], inputs.value_states[:, kv_heads]
    Dh, n = w.layout.head_dim, len(kv_heads)
    out = []
    for src, wt, bt in ((inputs.key_input, w.k_weight, w.k_bias), (inputs.value_input, w.v_weight, w.v_bias)):
        t = F.linear(src, _rows(wt, kv_heads, Dh), None if bt is None else _rows(bt, kv_heads, Dh))
        out.append(t.unflatten(-1, (n, Dh)).transpose(1, 2))  # (B, n, S, Dh)
    return out[0], out[1]


def token_gathered(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, sizes: GatherSizes) -> Tensor:
    """``(B, T, D)`` for a token plan ``(B, T, H)``; ``sizes.rows_per_head`` gives each head's packed length."""
    x = inputs.x
    B, T, _ = x.shape
    L = w.layout
    H, Dh, G = L.num_heads, L.head_dim, L.group_size
    D = w.o_weight.shape[0]
    mask = build_attention_mask(inputs, L.causal, x.dtype)
    rows = sizes.rows_per_head
    dense = [h for h in range(H) if rows[h] > 0 and rows[h] >= DENSE_HEAD_ROWS * T]
    routed = [h for h in range(H) if 0 < rows[h] < DENSE_HEAD_ROWS * T]
    kv_heads = sorted({h // G for h in dense + routed})
    slot = {g: i for i, g in enumerate(kv_heads)}
    keys, values = _project_kv(w, inputs, kv_heads)  # (B, nkv, S, Dh)
    if inputs.rotary is not None and inputs.key_states is None:
        keys = apply_rotary(keys, *inputs.rotary)

    def head_mask(m: Tensor, h: int) -> Tensor:
        return m[:, h if m.shape[1] > 1 else 0]  # (B|1, T, S) or (B|1, T)

    y = x.new_zeros(B, T, D)
    if dense:  # (B, nd, T, Dh) for the heads most tokens chose, as one dense block
        q = F.linear(x, _rows(w.q_weight, dense, Dh), None if w.q_bias is None else _rows(w.q_bias, dense, Dh))
        q = q.unflatten(-1, (len(dense), Dh)).transpose(1, 2)
        if inputs.rotary is not None:
            q = apply_rotary(q, *inputs.rotary)
        kv_ix = [slot[h // G] for h in dense]
        m = mask.mask
        if m is not None and m.shape[1] > 1:
            m = m[:, dense]
        out = F.scaled_dot_product_attention(q, keys[:, kv_ix], values[:, kv_ix], attn_mask=m,
                                             dropout_p=inputs.dropout_p, is_causal=mask.is_causal, scale=L.scale)
        if mask.dead is not None:
            dd = mask.dead if mask.dead.shape[1] == 1 else mask.dead[:, dense]
            out = out.masked_fill(dd.unsqueeze(-1), 0.0)
        out = out * plan.gates[:, :, dense].transpose(1, 2).unsqueeze(-1).to(out.dtype)  # (B, nd, T, Dh)
        y = F.linear(out.transpose(1, 2).reshape(B, T, -1), torch.cat([w.o_weight[:, h * Dh:(h + 1) * Dh]
                                                                       for h in dense], 1))
    flat = y.view(B * T, D)
    base = (torch.arange(B, device=x.device) * T).unsqueeze(1)  # (B, 1)
    for h in routed:
        Lh = rows[h]
        # The Lh tokens of each example that chose h first (ascending), then unchosen ones as gate-0 padding.
        pos = torch.argsort((~plan.active[:, :, h]).byte(), dim=1, stable=True)[:, :Lh]  # (B, Lh)
        xh = x.gather(1, pos.unsqueeze(-1).expand(B, Lh, x.shape[-1]))  # (B, Lh, D)
        q = F.linear(xh, w.q_weight[h * Dh:(h + 1) * Dh], None if w.q_bias is None else w.q_bias[h * Dh:(h + 1) * Dh])
        q = q.unsqueeze(1)  # (B, 1, Lh, Dh)
        if inputs.rotary is not None:
            cos, sin = (t.gather(1, pos.unsqueeze(-1).expand(B, Lh, Dh)) for t in inputs.rotary)
            q = apply_rotary(q, cos, sin)
        if mask.mask is not None:
            m = head_mask(mask.mask, h).expand(B, T, -1)
            attn_mask: Tensor | None = m.gather(1, pos.unsqueeze(-1).expand(B, Lh, m.shape[-1])).unsqueeze(1)
        elif mask.is_causal:
            attn_mask = causal_allowed(T, keys.shape[2], x.device)[pos].unsqueeze(1)  # (B, 1, Lh, S)
        else:
            attn_mask = None
        g = slot[h // G]
        out = F.scaled_dot_product_attention(q, keys[:, g:g + 1], values[:, g:g + 1], attn_mask=attn_mask,
                                             dropout_p=inputs.dropout_p, scale=L.scale).squeeze(1)  # (B, Lh, Dh)
        if mask.dead is not None:
            out = out.masked_fill(head_mask(mask.dead, h).expand(B, T).gather(1, pos).unsqueeze(-1), 0.0)
        out = out * plan.gates[:, :, h].gather(1, pos).unsqueeze(-1).to(out.dtype)
        src = F.linear(out, w.o_weight[:, h * Dh:(h + 1) * Dh])  # (B, Lh, D)
        flat.index_add_(0, (pos + base).reshape(-1), src.reshape(B * Lh, D))
    y = add_output_bias(y, w, plan)
    return zero_dead_rows(y, dead_rows(mask, B, T))
