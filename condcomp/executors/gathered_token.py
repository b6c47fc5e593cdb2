"""The gathered executor's token path (MoH): queries, attention rows and output only for chosen (token, head) pairs.

Keys and values are computed for every key/value head that some token of the batch chose (a later token may
pick any head, so the whole sequence's keys are needed). Heads that (nearly) every token chose, such as MoH's
shared heads, run densely as one block. The other ("routed") heads run together as one packed SDPA block: for
each routed head and example, the tokens that chose it fill ``L`` query slots, ``L`` being the largest such
count over heads and examples. Their query and output projections run per head set when the rows chose few
distinct sets (``_routed_by_set``: no padding in the matmuls, each input row gathered and each output row written
once), else per head on the padded slots (``_routed``: the padding is ``n_routed * B * L - (selected pairs)``
rows, and padded slots point at tokens whose gate is zero, so they add exact zeros). Outputs are summed back into
their tokens with one ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.executors.base import add_output_bias, keep_gates_in_graph, per_head, zero_dead_rows
from condcomp.executors.gathered import GatherSizes, head_set_keys
from condcomp.masks import AttentionMask, apply_rotary, build_attention_mask, causal_allowed, dead_rows, rotate_half
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

# A head chosen by at least this share of the (padded) query rows runs densely over all tokens: gathering
# would save less than it costs (docs/performance.md).
DENSE_HEAD_ROWS = 0.8
# Routed heads are projected per head set (``_routed_by_set``) while the rows chose at most this many distinct
# routed-head sets (each set costs two matmuls); past it, per head (``_routed``). MoH's top-2 of 6 makes 15.
MAX_HEAD_SETS = 32
# ... and while the sets' matmuls are large enough to pay for their number: mean rows per set times the model
# width at least this. Measured against the per-head path (docs/performance.md): 0.99-1.08x at about 70,000
# (slower in 4 of 5), 0.96-0.99x at 105,000, 0.81-0.98x from 140,000 on (CPU, 2 threads).
MIN_SET_WORK = 100_000


def _is_range(ix: list[int]) -> bool:
    """Whether ``ix`` is a non-empty contiguous ascending range (then a slice selects it: a view, no copy)."""
    return bool(ix) and ix == list(range(ix[0], ix[0] + len(ix)))


def _rows(w: Tensor, heads: list[int], Dh: int) -> Tensor:
    """The ``Dh``-row blocks of ``heads`` of an ``(n * Dh, ...)`` weight or bias, concatenated (a view when the
    heads are a contiguous ascending range)."""
    if _is_range(heads):
        return w[heads[0] * Dh:(heads[0] + len(heads)) * Dh]
    return torch.cat([w[h * Dh:(h + 1) * Dh] for h in heads]) if heads else w[:0]


def _project(w: AttentionWeights, inputs: AttentionInputs, q_heads: list[int],
             kv_heads: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Queries ``(B, len(q_heads), T, Dh)`` and keys/values ``(B, len(kv_heads), S, Dh)`` of the listed heads."""
    Dh = w.layout.head_dim
    x = inputs.x
    nq, nkv = len(q_heads), len(kv_heads)

    def bias(b: Tensor | None, heads: list[int]) -> Tensor | None:
        return None if b is None else _rows(b, heads, Dh)

    def heads_first(t: Tensor, n: int) -> Tensor:
        return t.unflatten(-1, (n, Dh)).transpose(1, 2)  # (B, n, T|S, Dh)

    cached = inputs.key_states is not None and inputs.value_states is not None
    if inputs.key is None and inputs.value is None and not cached:  # self-attention: one fused projection
        parts = ((w.q_weight, w.q_bias, q_heads), (w.k_weight, w.k_bias, kv_heads), (w.v_weight, w.v_bias, kv_heads))
        wt = torch.cat([_rows(wp, heads, Dh) for wp, _, heads in parts])
        fused_b = None
        if any(b is not None for _, b, _ in parts):  # a missing bias (e.g. no key bias) is a zero block
            fused_b = torch.cat([x.new_zeros(len(heads) * Dh) if b is None else _rows(b, heads, Dh)
                                 for _, b, heads in parts])
        out = F.linear(x, wt, fused_b)
        q, k, v = out.split([nq * Dh, nkv * Dh, nkv * Dh], -1)
        return heads_first(q, nq), heads_first(k, nkv), heads_first(v, nkv)
    q = heads_first(F.linear(x, _rows(w.q_weight, q_heads, Dh), bias(w.q_bias, q_heads)), nq)
    if cached:
        assert inputs.key_states is not None and inputs.value_states is not None
        return q, inputs.key_states[:, kv_heads], inputs.value_states[:, kv_heads]
    k = F.linear(inputs.key_input, _rows(w.k_weight, kv_heads, Dh), bias(w.k_bias, kv_heads))
    v = F.linear(inputs.value_input, _rows(w.v_weight, kv_heads, Dh), bias(w.v_bias, kv_heads))
    return q, heads_first(k, nkv), heads_first(v, nkv)


_INDEX_CACHE: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _index(ix: list[int], device: torch.device) -> Tensor:
    """``ix`` as a device tensor, cached: a fresh host-to-device copy per call would stall the CUDA stream."""
    key = (tuple(ix), device)
    if key not in _INDEX_CACHE:
        if len(_INDEX_CACHE) > 4096:
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = torch.tensor(ix, dtype=torch.long, device=device)
    return _INDEX_CACHE[key]


def _take(t: Tensor, ix: list[int]) -> Tensor:
    """``t[:, ix]``, as a view when ``ix`` is a contiguous ascending range."""
    if _is_range(ix):
        return t[:, ix[0]:ix[0] + len(ix)]
    return t.index_select(1, _index(ix, t.device))


def _heads_of(t: Tensor, heads: list[int]) -> Tensor:
    """Dim 1 of a mask-like ``(B|1, H|1, ...)`` tensor restricted to ``heads`` (kept at 1 when broadcast)."""
    return t if t.shape[1] == 1 else _take(t, heads)


def _routed(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, mask: AttentionMask, routed: list[int],
            slots: int, keys: Tensor, values: Tensor, y: Tensor) -> None:
    """Add the packed routed heads' output into ``y (B, T, D)`` in place.

    The routed heads are SDPA's batch and the examples its heads, ``(nR, B, L, Dh)``: the per-head projections'
    output needs no transpose, and SDPA's output (stored ``(nR, L, B, Dh)`` by the fused kernels) is read in that
    order for the output projection, so nothing between the two projections copies but the gate multiply."""
    x = inputs.x
    B, T, D_in = x.shape
    H, Dh, nR = w.layout.num_heads, w.layout.head_dim, len(routed)
    D, S = w.o_weight.shape[0], keys.shape[2]
    R = _index(routed, x.device)
    # (nR, B, L): per routed head and example, the tokens that chose it first (ascending), then gate-0 padding.
    pos = torch.argsort((~plan.active.index_select(2, R)).permute(2, 0, 1).byte(), dim=-1, stable=True)[..., :slots]
    rows = pos + (torch.arange(B, device=x.device) * T)[None, :, None]  # (nR, B, L) rows of x viewed (B*T, D)
    flat = rows.reshape(-1)
    xr = x.reshape(B * T, D_in).index_select(0, flat).view(nR, B * slots, D_in)
    wq = w.q_weight.view(H, Dh, D_in).index_select(0, R).transpose(1, 2)  # (nR, D_in, Dh)
    if w.q_bias is None:
        q = torch.bmm(xr, wq)
    else:
        q = torch.baddbmm(w.q_bias.view(H, 1, Dh).index_select(0, R), xr, wq)  # (nR, B*L, Dh)
    del xr  # (nR*B*L, D_in) is the largest temporary: free it before the output projection allocates as much
    q = q.view(nR, B, slots, Dh)
    if inputs.rotary is not None:
        cos, sin = (t.reshape(B * T, Dh).index_select(0, flat).view(nR, B, slots, Dh) for t in inputs.rotary)
        q = q * cos + rotate_half(q) * sin
    attn_mask: Tensor | None = None
    if mask.mask is not None:
        m = _heads_of(mask.mask, routed).expand(B, nR, T, S).transpose(0, 1)  # (nR, B, T, S)
        attn_mask = m.gather(2, pos.unsqueeze(-1).expand(nR, B, slots, S))  # (nR, B, L, S)
    elif mask.is_causal:
        attn_mask = causal_allowed(T, S, x.device)[pos]  # (nR, B, L, S)
    out = F.scaled_dot_product_attention(q, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=attn_mask,
                                         dropout_p=inputs.dropout_p, scale=w.layout.scale)  # (nR, B, L, Dh)
    if mask.dead is not None:
        dead = _heads_of(mask.dead, routed).expand(B, nR, T).transpose(0, 1).gather(2, pos)  # (nR, B, L)
        out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    gates = plan.gates.reshape(-1).index_select(0, (rows * H + R[:, None, None]).reshape(-1))  # (nR*B*L,)
    # (nR, L, B, Dh): contiguous when SDPA stored its output that way (then the reshape below is a view)
    out = out.transpose(1, 2) * gates.view(nR, B, slots).transpose(1, 2).unsqueeze(-1).to(out.dtype)
    wo = w.o_weight.view(D, H, Dh).index_select(1, R).permute(1, 2, 0)  # (nR, Dh, D), a transposed view
    src = torch.bmm(out.reshape(nR, slots * B, Dh), wo).view(-1, D)  # (nR*L*B, D)
    y.view(B * T, D).index_add_(0, rows.transpose(1, 2).reshape(-1), src.to(y.dtype))


def routed_head_sets(head_sets: tuple[tuple[int, int], ...], routed: list[int],
                     limit: int | None = None) -> list[tuple[int, int]] | None:
    """``(mask, rows)`` of every routed-head set the rows chose, ascending by mask; bit ``j`` of a mask stands
    for ``routed[j]``. ``head_sets`` are the sizes' sets over all heads (the dense heads are dropped). None as
    soon as more than ``limit`` non-empty sets turn up."""
    rows: dict[int, int] = {}
    for key, n in head_sets:
        m = sum(1 << j for j, h in enumerate(routed) if key >> h & 1)
        rows[m] = rows.get(m, 0) + n
        if limit is not None and len(rows) - (0 in rows) > limit:
            return None
    return sorted(rows.items())


def per_set_pays(sets: list[tuple[int, int]], width: int) -> bool:
    """Whether ``sets`` (from :func:`routed_head_sets`) are few and large enough for per-set matmuls: mean rows
    per non-empty set times the input width at least ``MIN_SET_WORK``."""
    chosen = [n for m, n in sets if m]
    return bool(chosen) and sum(chosen) / len(chosen) * width >= MIN_SET_WORK


def _compact(selected: Tensor, n: int) -> Tensor:
    """Positions of the ``n`` True entries of a flat bool tensor, ascending: ``nonzero`` without a host read,
    since ``n`` is already known on the host (the others are scattered into one extra slot, then dropped)."""
    dest = torch.where(selected, torch.cumsum(selected, 0) - 1, n)
    src = torch.arange(selected.numel(), device=selected.device)
    return torch.empty(n + 1, dtype=torch.long, device=selected.device).scatter_(0, dest, src)[:n]


def _routed_by_set(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, mask: AttentionMask,
                   routed: list[int], sets: list[tuple[int, int]], slots: int, keys: Tensor, values: Tensor,
                   y: Tensor) -> None:
    """Add the routed heads' output into ``y (B, T, D)`` in place, projecting per head set.

    Rows (tokens) that chose the same routed heads are grouped: each group's queries come from one projection of
    its input rows with those heads' weights, and its outputs from one projection of those heads' attention
    outputs, so every input row is gathered once and every output row written once (per head it would be once per
    chosen head, at a quarter of the matmul width). Attention still runs per head and example: each (row, head)
    pair's query is placed in its slot of the packed ``(nR, B, L, Dh)`` block and its output read back from it."""
    x = inputs.x
    B, T, D_in = x.shape
    H, Dh, nR = w.layout.num_heads, w.layout.head_dim, len(routed)
    D, S = w.o_weight.shape[0], keys.shape[2]
    R = _index(routed, x.device)
    active = plan.active.index_select(2, R)  # (B, T, nR)
    flat_active = active.reshape(B * T, nR)
    by_set = torch.argsort(head_set_keys(flat_active), stable=True)  # (B*T,) rows grouped by routed set
    chosen = [(m, n) for m, n in sets if m]
    tok = by_set[sum(n for m, n in sets if not m):]  # (M,) rows with some routed head, grouped by set, ascending
    set_heads = [[j for j in range(nR) if m >> j & 1] for m, _ in chosen]
    heads = R.index_select(0, _index([j for hs in set_heads for j in hs], x.device))  # (sum r,) heads per set
    wq = per_head(w.q_weight, H, Dh).index_select(0, heads)  # (sum r, Dh, D_in)
    bq = None if w.q_bias is None else per_head(w.q_bias, H, Dh).index_select(0, heads)  # (sum r, Dh)
    xs = x.reshape(B * T, D_in).index_select(0, tok)  # (M, D_in)
    # split (not slicing) so that backward joins the pieces' gradients with one cat instead of one full-size
    # zero-filled gradient per slice
    widths, counts = [len(hs) for hs in set_heads], [n for _, n in chosen]
    q = torch.cat([
        F.linear(x_s, w_s.reshape(-1, D_in), None if b_s is None else b_s.reshape(-1)).view(-1, Dh)
        for x_s, w_s, b_s in zip(xs.split(counts), wq.split(widths),
                                 bq.split(widths) if bq is not None else [None] * len(widths))
    ])  # (P, Dh): per set, per row, its heads ascending
    del xs
    # the same (row, head) pairs, in the same order, as positions in the (M, nR) selection
    pair = _compact(flat_active.index_select(0, tok).reshape(-1), q.shape[0])  # (P,)
    j = pair % nR  # (P,) position of the pair's head in ``routed``
    token = tok.index_select(0, torch.div(pair, nR, rounding_mode="floor"))  # (P,) row of x viewed (B*T, D)
    b = torch.div(token, T, rounding_mode="floor")
    rank = (active.cumsum(1) - 1).reshape(-1).index_select(0, token * nR + j)  # (P,) among its example's rows
    if inputs.rotary is not None:
        cos, sin = (t.reshape(B * T, Dh).index_select(0, token) for t in inputs.rotary)
        q = q * cos + rotate_half(q) * sin
    q = q.new_zeros(nR * B * slots, Dh).index_copy_(0, (j * B + b) * slots + rank, q).view(nR, B, slots, Dh)
    attn_mask: Tensor | None = None
    if mask.mask is not None or mask.is_causal:
        # (nR, B, L) key positions of the slots: the rows that chose the head first (ascending, as ``rank``
        # counts them), then rows that did not; the latter's outputs are never read
        pos = torch.argsort((~active).permute(2, 0, 1).byte(), dim=-1, stable=True)[..., :slots]
        if mask.mask is not None:
            m = _heads_of(mask.mask, routed).expand(B, nR, T, S).transpose(0, 1)  # (nR, B, T, S)
            attn_mask = m.gather(2, pos.unsqueeze(-1).expand(nR, B, slots, S))  # (nR, B, L, S)
        else:
            attn_mask = causal_allowed(T, S, x.device)[pos]  # (nR, B, L, S)
    out = F.scaled_dot_product_attention(q, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=attn_mask,
                                         dropout_p=inputs.dropout_p, scale=w.layout.scale)  # (nR, B, L, Dh)
    if out.transpose(1, 2).is_contiguous():  # the fused kernels store it (nR, L, B, Dh)
        o = out.transpose(1, 2).reshape(-1, Dh).index_select(0, (j * slots + rank) * B + b)  # (P, Dh)
    else:
        o = out.reshape(-1, Dh).index_select(0, (j * B + b) * slots + rank)
    if mask.dead is not None:
        dead = _heads_of(mask.dead, routed).expand(B, nR, T).reshape(-1)  # (B*nR*T,)
        o = o.masked_fill(dead.index_select(0, (b * nR + j) * T + token - b * T).unsqueeze(-1), 0.0)
    gates = plan.gates.reshape(-1).index_select(0, token * H + R.index_select(0, j))  # (P,)
    o = o * gates.unsqueeze(-1).to(o.dtype)
    wo = w.o_weight.view(D, H, Dh).index_select(1, heads)  # (D, sum r, Dh)
    srcs = [F.linear(o_s.view(n, -1), wo_s.reshape(D, -1))
            for o_s, wo_s, n in zip(o.split([n * r for n, r in zip(counts, widths)]), wo.split(widths, 1), counts)]
    y.view(B * T, D).index_add_(0, tok, torch.cat(srcs).to(y.dtype))


def heads_block(w: AttentionWeights, inputs: AttentionInputs, mask: AttentionMask, heads: list[int], q: Tensor,
                keys: Tensor, values: Tensor, gates: Tensor, o_bias: Tensor | None) -> Tensor:
    """``(B, T, D)`` of a fixed head list for every row: queries ``(B, n, T, Dh)``, keys/values per query head
    ``(B, n, S, Dh)``, gates ``(B, n, T|1, 1)``; the output projection uses only these heads' columns."""
    x = inputs.x
    B, T, _ = x.shape
    Dh = w.layout.head_dim
    m = None if mask.mask is None else _heads_of(mask.mask, heads)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=m, dropout_p=inputs.dropout_p,
                                         is_causal=mask.is_causal, scale=w.layout.scale)  # (B, n, T, Dh)
    if mask.dead is not None:
        out = out.masked_fill(_heads_of(mask.dead, heads).unsqueeze(-1), 0.0)
    out = out * gates.to(out.dtype)
    wo = _take(w.o_weight.view(-1, w.layout.num_heads, Dh), heads).flatten(1)  # (D, n*Dh)
    return F.linear(out.transpose(1, 2).reshape(B, T, len(heads) * Dh), wo, o_bias).to(x.dtype)


def _project_rotated(w: AttentionWeights, inputs: AttentionInputs, heads: list[int],
                     kv_heads: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """``_project`` with rotary applied to the queries and to freshly projected keys (a cache is already rotated)."""
    q, keys, values = _project(w, inputs, heads, kv_heads)
    if inputs.rotary is not None:
        q = apply_rotary(q, *inputs.rotary)
        if inputs.key_states is None:
            keys = apply_rotary(keys, *inputs.rotary)
    return q, keys, values


def shared_set(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, mask: AttentionMask,
               heads: list[int]) -> Tensor:
    """``(B, T, D)`` of a sequence plan in which every example chose the same heads: a plain k-head block."""
    G = w.layout.group_size
    kv_heads = sorted({h // G for h in heads})
    slot = {g: i for i, g in enumerate(kv_heads)}
    q, keys, values = _project_rotated(w, inputs, heads, kv_heads)  # (B, k, T, Dh), (B, kkv, S, Dh)
    kv_ix = [slot[h // G] for h in heads]
    gates = _take(plan.gates, heads)[:, :, None, None]  # (B, k, 1, 1)
    return heads_block(w, inputs, mask, heads, q, _take(keys, kv_ix), _take(values, kv_ix), gates, w.o_bias)


def token_gathered(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, sizes: GatherSizes) -> Tensor:
    """``(B, T, D)`` for a token plan ``(B, T, H)``; ``sizes.rows_per_head`` gives each head's packed length."""
    x = inputs.x
    B, T, _ = x.shape
    L = w.layout
    H, G = L.num_heads, L.group_size
    D = w.o_weight.shape[0]
    mask = build_attention_mask(inputs, L.causal, x.dtype)
    rows = sizes.rows_per_head
    dense = [h for h in range(H) if rows[h] > 0 and rows[h] >= DENSE_HEAD_ROWS * T]
    routed = [h for h in range(H) if 0 < rows[h] < DENSE_HEAD_ROWS * T]
    kv_heads = sorted({h // G for h in dense + routed})
    slot = {g: i for i, g in enumerate(kv_heads)}
    q, keys, values = _project_rotated(w, inputs, dense, kv_heads)  # (B, nd, T, Dh), (B, nkv, S, Dh)
    # every row gets the output bias: fold it into the dense block's output projection (saves a pass over y)
    bias_in_block = bool(dense) and sizes.every_row_active
    if dense:  # the heads most tokens chose, as one dense block
        gates = _take(plan.gates.transpose(1, 2), dense).unsqueeze(-1)  # (B, nd, T, 1)
        y = heads_block(w, inputs, mask, dense, q, _take(keys, [slot[h // G] for h in dense]),
                        _take(values, [slot[h // G] for h in dense]), gates, w.o_bias if bias_in_block else None)
    else:
        y = x.new_zeros(B, T, D)
    if routed:
        kv_ix = [slot[h // G] for h in routed]
        kr, vr = _take(keys, kv_ix), _take(values, kv_ix)
        slots = max(rows[h] for h in routed)
        sets = routed_head_sets(sizes.head_sets, routed, MAX_HEAD_SETS) if sizes.head_sets else None
        if sets and per_set_pays(sets, x.shape[-1]):
            _routed_by_set(w, inputs, plan, mask, routed, sets, slots, kr, vr, y)
        else:
            _routed(w, inputs, plan, mask, routed, slots, kr, vr, y)
    y = keep_gates_in_graph(y, plan)  # no head anywhere: zero output, still in the graph
    if not bias_in_block:
        y = add_output_bias(y, w, plan)
    return zero_dead_rows(y, dead_rows(mask, B, T))
