"""Token-plan strategies (MoH: each (token, head) pair chooses), tried in this order (strategies.py):

Keys and values are computed for every key/value head that some token of the batch chose (a later token may pick
any head, so the whole sequence's keys are needed). Heads that at least ``tuning.dense_head_rows`` of the rows
chose, such as MoH's shared heads, run densely as one k-head block. The other ("routed") heads run together as one
packed SDPA block: for each routed head and example, the tokens that chose it fill ``L`` query slots, ``L`` being
the largest such count over heads and examples.

1. ``token.dense``: no routed head: the dense block is the whole call.
2. ``token.by_set``: the routed heads' query and output projections run per head set while the rows chose few,
   large sets (no padding in the matmuls; each input row gathered and each output row written once).
3. ``token.per_head``: per routed head on the padded slots (the padding is ``n_routed * B * L - pairs`` rows;
   padded slots point at tokens whose gate is zero, so they add exact zeros).

Outputs are summed back into their tokens with one ``index_add_``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from condcomp.executors.base import add_output_bias, keep_gates_in_graph, per_head, zero_dead_rows
from condcomp.executors.gathered.blocks import heads_block, heads_of, index, project_heads, take
from condcomp.executors.gathered.call import GatheredCall, Strategy
from condcomp.executors.gathered.sizing import head_set_keys
from condcomp.masks import causal_allowed, dead_rows
from condcomp.rotary import rotate_half

RoutedPart = Callable[[GatheredCall, int, Tensor, Tensor, Tensor], None]  # call, slots, keys, values, y


def _routed(call: GatheredCall, slots: int, keys: Tensor, values: Tensor, y: Tensor) -> None:
    """Add the packed routed heads' output into ``y (B, T, D)`` in place.

    The routed heads are SDPA's batch and the examples its heads, ``(nR, B, L, Dh)``: the per-head projections'
    output needs no transpose, and SDPA's output (stored ``(nR, L, B, Dh)`` by the fused kernels) is read in that
    order for the output projection, so nothing between the two projections copies but the gate multiply."""
    w, inputs, plan, mask, routed = call.weights, call.inputs, call.plan, call.mask, call.token_split.routed
    x = inputs.x
    B, T, D_in = x.shape
    H, Dh, nR = w.layout.num_heads, w.layout.head_dim, len(routed)
    D, S = w.o_weight.shape[0], keys.shape[2]
    R = index(routed, x.device)
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
    q = w.norm_queries(q.view(nR, B, slots, Dh))
    if inputs.rotary is not None:
        cos, sin = (t.reshape(B * T, Dh).index_select(0, flat).view(nR, B, slots, Dh) for t in inputs.rotary)
        q = q * cos + rotate_half(q) * sin
    attn_mask: Tensor | None = None
    if mask.mask is not None:
        m = heads_of(mask.mask, routed).expand(B, nR, T, S).transpose(0, 1)  # (nR, B, T, S)
        attn_mask = m.gather(2, pos.unsqueeze(-1).expand(nR, B, slots, S))  # (nR, B, L, S)
    elif mask.is_causal:
        attn_mask = causal_allowed(T, S, x.device)[pos]  # (nR, B, L, S)
    out = F.scaled_dot_product_attention(q, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=attn_mask,
                                         dropout_p=inputs.dropout_p, scale=w.layout.scale)  # (nR, B, L, Dh)
    if mask.dead is not None:
        dead = heads_of(mask.dead, routed).expand(B, nR, T).transpose(0, 1).gather(2, pos)  # (nR, B, L)
        out = out.masked_fill(dead.unsqueeze(-1), 0.0)
    gates = plan.gates.reshape(-1).index_select(0, (rows * H + R[:, None, None]).reshape(-1))  # (nR*B*L,)
    # (nR, L, B, Dh): contiguous when SDPA stored its output that way (then the reshape below is a view)
    out = out.transpose(1, 2) * gates.view(nR, B, slots).transpose(1, 2).unsqueeze(-1).to(out.dtype)
    wo = w.o_weight.view(D, H, Dh).index_select(1, R).permute(1, 2, 0)  # (nR, Dh, D), a transposed view
    src = torch.bmm(out.reshape(nR, slots * B, Dh), wo).view(-1, D)  # (nR*L*B, D)
    y.view(B * T, D).index_add_(0, rows.transpose(1, 2).reshape(-1), src.to(y.dtype))



def _compact(selected: Tensor, n: int) -> Tensor:
    """Positions of the ``n`` True entries of a flat bool tensor, ascending: ``nonzero`` without a host read,
    since ``n`` is already known on the host (the others are scattered into one extra slot, then dropped)."""
    dest = torch.where(selected, torch.cumsum(selected, 0) - 1, n)
    src = torch.arange(selected.numel(), device=selected.device)
    return torch.empty(n + 1, dtype=torch.long, device=selected.device).scatter_(0, dest, src)[:n]



@dataclass(frozen=True)
class _RowSets:
    """A token plan's rows grouped by the set of routed heads they chose, and their (row, head) pairs in the order
    the per-set projections produce them (per set, per row, its heads ascending)."""

    rows: Tensor  # (M,) rows of x viewed (B*T, D) that chose some routed head, grouped by set, ascending
    counts: list[int]  # rows per set
    widths: list[int]  # heads per set
    heads: Tensor  # (sum widths,) each set's heads, ascending
    j: Tensor  # (P,) each pair's position in ``routed``
    token: Tensor  # (P,) each pair's row of x viewed (B*T, D)
    b: Tensor  # (P,) each pair's example
    rank: Tensor  # (P,) each pair's rank among the rows of its example that chose its head


def _row_sets(call: GatheredCall, R: Tensor, active: Tensor) -> _RowSets:
    """Group the rows by routed-head set (``active (B, T, nR)``: which routed heads each row chose)."""
    B, T, nR = active.shape
    sets = call.token_split.sets or []
    flat_active = active.reshape(B * T, nR)
    by_set = torch.argsort(head_set_keys(flat_active), stable=True)  # (B*T,) rows grouped by routed set
    chosen = [(m, n) for m, n in sets if m]
    rows = by_set[sum(n for m, n in sets if not m):]
    set_heads = [[j for j in range(nR) if m >> j & 1] for m, _ in chosen]
    heads = R.index_select(0, index([j for hs in set_heads for j in hs], R.device))
    counts, widths = [n for _, n in chosen], [len(hs) for hs in set_heads]
    # the pairs, in the per-set order, as positions in the (M, nR) selection
    pair = _compact(flat_active.index_select(0, rows).reshape(-1), sum(n * r for n, r in zip(counts, widths)))
    j = pair % nR
    token = rows.index_select(0, torch.div(pair, nR, rounding_mode="floor"))
    rank = (active.cumsum(1) - 1).reshape(-1).index_select(0, token * nR + j)
    return _RowSets(rows, counts, widths, heads, j, token, torch.div(token, T, rounding_mode="floor"), rank)


def _set_queries(call: GatheredCall, sets: _RowSets) -> Tensor:
    """``(P, Dh)``: each pair's query, from one projection per set of its rows with its heads' weights (normed and
    rotated like every query)."""
    w, inputs = call.weights, call.inputs
    x = inputs.x
    B, T, D_in = x.shape
    H, Dh = w.layout.num_heads, w.layout.head_dim
    wq = per_head(w.q_weight, H, Dh).index_select(0, sets.heads)  # (sum r, Dh, D_in)
    bq = None if w.q_bias is None else per_head(w.q_bias, H, Dh).index_select(0, sets.heads)  # (sum r, Dh)
    xs = x.reshape(B * T, D_in).index_select(0, sets.rows)  # (M, D_in)
    # split (not slicing) so that backward joins the pieces' gradients with one cat instead of one full-size
    # zero-filled gradient per slice
    q = torch.cat([
        F.linear(x_s, w_s.reshape(-1, D_in), None if b_s is None else b_s.reshape(-1)).view(-1, Dh)
        for x_s, w_s, b_s in zip(xs.split(sets.counts), wq.split(sets.widths),
                                 bq.split(sets.widths) if bq is not None else [None] * len(sets.widths))
    ])  # (P, Dh)
    q = w.norm_queries(q)
    if inputs.rotary is not None:
        cos, sin = (t.reshape(B * T, Dh).index_select(0, sets.token) for t in inputs.rotary)
        q = q * cos + rotate_half(q) * sin
    return q


def _slot_mask(call: GatheredCall, active: Tensor, slots: int, S: int) -> Tensor | None:
    """``(nR, B, L, S)`` bool: the keys each slot of the packed block may attend to (None: every key)."""
    mask, routed = call.mask, call.token_split.routed
    if mask.mask is None and not mask.is_causal:
        return None
    B, T, nR = active.shape
    # (nR, B, L) key positions of the slots: the rows that chose the head first (ascending, as ``rank`` counts
    # them), then rows that did not; the latter's outputs are never read
    pos = torch.argsort((~active).permute(2, 0, 1).byte(), dim=-1, stable=True)[..., :slots]
    if mask.mask is not None:
        m = heads_of(mask.mask, routed).expand(B, nR, T, S).transpose(0, 1)  # (nR, B, T, S)
        return m.gather(2, pos.unsqueeze(-1).expand(nR, B, slots, S))  # (nR, B, L, S)
    return causal_allowed(T, S, active.device)[pos]  # (nR, B, L, S)


def _add_set_outputs(call: GatheredCall, sets: _RowSets, R: Tensor, o: Tensor, y: Tensor) -> None:
    """Gate each pair's attention output ``o (P, Dh)`` and add it into ``y (B, T, D)`` through one output
    projection per set (each output row written once)."""
    w, plan, mask, routed = call.weights, call.plan, call.mask, call.token_split.routed
    B, T, D = y.shape
    H, Dh, nR = w.layout.num_heads, w.layout.head_dim, len(routed)
    if mask.dead is not None:
        dead = heads_of(mask.dead, routed).expand(B, nR, T).reshape(-1)  # (B*nR*T,)
        o = o.masked_fill(dead.index_select(0, (sets.b * nR + sets.j) * T + sets.token - sets.b * T).unsqueeze(-1),
                          0.0)
    gates = plan.gates.reshape(-1).index_select(0, sets.token * H + R.index_select(0, sets.j))  # (P,)
    o = o * gates.unsqueeze(-1).to(o.dtype)
    wo = w.o_weight.view(D, H, Dh).index_select(1, sets.heads)  # (D, sum r, Dh)
    pieces = o.split([n * r for n, r in zip(sets.counts, sets.widths)])
    srcs = [F.linear(o_s.view(n, -1), wo_s.reshape(D, -1))
            for o_s, wo_s, n in zip(pieces, wo.split(sets.widths, 1), sets.counts)]
    y.view(B * T, D).index_add_(0, sets.rows, torch.cat(srcs).to(y.dtype))


def _routed_by_set(call: GatheredCall, slots: int, keys: Tensor, values: Tensor, y: Tensor) -> None:
    """Add the routed heads' output into ``y (B, T, D)`` in place, projecting per head set.

    Rows (tokens) that chose the same routed heads are grouped: each group's queries come from one projection of
    its input rows with those heads' weights, and its outputs from one projection of those heads' attention
    outputs, so every input row is gathered once and every output row written once (per head it would be once per
    chosen head, at a quarter of the matmul width). Attention still runs per head and example: each (row, head)
    pair's query is placed in its slot of the packed ``(nR, B, L, Dh)`` block and its output read back from it."""
    w, inputs, routed = call.weights, call.inputs, call.token_split.routed
    B, T, _ = inputs.x.shape
    Dh, nR = w.layout.head_dim, len(routed)
    R = index(routed, inputs.x.device)
    active = call.plan.active.index_select(2, R)  # (B, T, nR)
    sets = _row_sets(call, R, active)
    q = _set_queries(call, sets)  # (P, Dh)
    q = q.new_zeros(nR * B * slots, Dh).index_copy_(0, (sets.j * B + sets.b) * slots + sets.rank, q)
    out = F.scaled_dot_product_attention(q.view(nR, B, slots, Dh), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=_slot_mask(call, active, slots, keys.shape[2]),
                                         dropout_p=inputs.dropout_p, scale=w.layout.scale)  # (nR, B, L, Dh)
    if out.transpose(1, 2).is_contiguous():  # the fused kernels store it (nR, L, B, Dh)
        o = out.transpose(1, 2).reshape(-1, Dh).index_select(0, (sets.j * slots + sets.rank) * B + sets.b)
    else:
        o = out.reshape(-1, Dh).index_select(0, (sets.j * B + sets.b) * slots + sets.rank)
    _add_set_outputs(call, sets, R, o, y)  # o: (P, Dh)


def _token(call: GatheredCall, routed_part: RoutedPart | None) -> Tensor:
    """``(B, T, D)``: the dense heads as one block, then ``routed_part`` adds the routed heads in place."""
    w, inputs, plan, mask = call.weights, call.inputs, call.plan, call.mask
    x = inputs.x
    B, T, _ = x.shape
    G, D = w.layout.group_size, w.o_weight.shape[0]
    split = call.token_split
    dense, routed = split.dense, split.routed
    kv_heads = sorted({h // G for h in dense + routed})
    slot = {g: i for i, g in enumerate(kv_heads)}
    q, keys, values = project_heads(w, inputs, dense, kv_heads)  # (B, nd, T, Dh), (B, nkv, S, Dh)
    # every row gets the output bias: fold it into the dense block's output projection (saves a pass over y)
    bias_in_block = bool(dense) and call.sizes.every_row_active
    if dense:  # the heads most tokens chose, as one dense block
        gates = take(plan.gates.transpose(1, 2), dense).unsqueeze(-1)  # (B, nd, T, 1)
        y = heads_block(w, inputs, mask, dense, q, take(keys, [slot[h // G] for h in dense]),
                        take(values, [slot[h // G] for h in dense]), gates, w.o_bias if bias_in_block else None)
    else:
        y = x.new_zeros(B, T, D)
    if routed and routed_part is not None:
        kv_ix = [slot[h // G] for h in routed]
        slots = max(call.sizes.rows_per_head[h] for h in routed)
        routed_part(call, slots, take(keys, kv_ix), take(values, kv_ix), y)
    y = keep_gates_in_graph(y, plan)  # no head anywhere: zero output, still in the graph
    if not bias_in_block:
        y = add_output_bias(y, w, plan)
    return zero_dead_rows(y, dead_rows(mask, B, T))


class Dense(Strategy):
    name, granularity = "token.dense", "token"

    @override
    def supports(self, call: GatheredCall) -> list[str]:
        routed = call.token_split.routed
        if not routed:
            return []
        return [f"heads {routed} are routed (each chosen by fewer than tuning.dense_head_rows of the rows)"]

    @override
    def run(self, call: GatheredCall) -> Tensor:
        return _token(call, None)


class BySet(Strategy):
    name, granularity = "token.by_set", "token"

    @override
    def supports(self, call: GatheredCall) -> list[str]:
        t, split = call.tuning, call.token_split
        if not split.routed:
            return ["no routed head"]
        if call.plan.num_heads > t.max_set_heads:
            return [f"{call.plan.num_heads} heads, over tuning.max_set_heads = {t.max_set_heads}"]
        if not call.sizes.head_sets:
            return [f"B*T*D = {call.inputs.x.numel():,} below tuning.min_set_work = {t.min_set_work:,}"]
        if split.sets is None:
            return [f"the rows chose more than tuning.max_head_sets = {t.max_head_sets} routed-head sets"]
        chosen = [n for m, n in split.sets if m]
        work = sum(chosen) / len(chosen) * call.inputs.x.shape[-1] if chosen else 0.0
        if work < t.min_set_work:
            return [f"mean rows per set x width = {work:,.0f}, below tuning.min_set_work = {t.min_set_work:,}"]
        return []

    @override
    def run(self, call: GatheredCall) -> Tensor:
        return _token(call, _routed_by_set)


class PerHead(Strategy):
    name, granularity = "token.per_head", "token"

    @override
    def run(self, call: GatheredCall) -> Tensor:
        return _token(call, _routed)
