"""The gathered-sparse executor: only the selected (example, head) or (token, head) pairs are computed.

Sequence plans (one head set per example, variable ``k``): when every example chose the same heads, one plain
k-head block on those heads' weight slices. Otherwise, on CPU in float32/float64 without autocast (self- and
cross-attention, GQA, KV cache), grouped GEMMs over the selected (example, head) pairs read input rows and weight
blocks in place (:func:`condcomp.executors.gathered_pairs.sequence_pairs_grouped`, MKL through
:mod:`condcomp.executors.grouped_gemm`): no copies and no padding; a plan whose examples all have the same ``k``
keeps the single bucket below while its weight copy is under ``MIN_GROUPED_COPY``. Everywhere else examples are
bucketed by ``(k, k_kv)``: the number of active query heads and of key/value heads they use. Inside a bucket every
example has the same shape of work, so the selected heads' weight slices are gathered per example and the block
runs as batched matmuls (``torch.bmm``) and one SDPA call over ``(n, k, T, Dh)``; the output projection sums over
the selected heads inside its matmul and each example's output row lands in place with ``index_copy_`` (examples
belong to exactly one bucket: no scatter-add). There is no padding at all: the overhead over a k-head block is
gathering ``4 * k * Dh * D`` weights and the input rows per example. (``PACK_PAIRS`` switches to
:mod:`condcomp.executors.gathered_pairs`.)

Token plans (MoH) are in :mod:`condcomp.executors.gathered_token`.

Sizing needs one host synchronisation per call (a ``bincount`` read back); nothing else syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.executors import grouped_gemm
from condcomp.executors.base import keep_gates_in_graph, per_head, qkv_head_rows, zero_dead_rows
from condcomp.executors.gathered_pairs import sequence_pairs, sequence_pairs_grouped
from condcomp.masks import AttentionMask, apply_rotary, build_attention_mask, dead_rows
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

# Variable-k sequence plans in the fused layout can run as packed pairs (gathered_pairs.py: a fixed number of
# kernels, P*T*D more copies) instead of one block per k bucket. Measured with OMP_WAIT_POLICY=PASSIVE, the
# buckets win (docs/performance.md); the pairs win only where every extra kernel costs a scheduling round.
PACK_PAIRS = False

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# When every example uses the same number of heads, the buckets are one batched block that gathers no input rows,
# only the selected heads' q/k/v weight slices (about pairs * 3 * Dh * D floats). Below this many the block beats
# the grouped GEMMs' fixed cost: grouped/block measured 1.07-1.35x at 0.2-0.8 million floats, 0.96-1.17x at 1.6
# million and 0.85-0.91x at 3.1 million (CPU, forward; docs/performance.md, "Fifth round"). Plans whose examples
# use different numbers of heads take the grouped GEMMs at every size (0.78-0.97x the buckets).
MIN_GROUPED_COPY = 2_000_000

# Token plans over at most this many heads also read back how many rows chose each head set (a 2**H-bin
# histogram in the same read), so the routed heads can be projected per head set (gathered_token.py).
MAX_SET_HEADS = 12


@dataclass(frozen=True)
class GatherSizes:
    """Host-side sizes of one call's packed work (the single device -> host read of the gathered path).

    ``buckets``: sequence plans, ``(k, k_kv, n_examples)`` in the order the examples are sorted by.
    ``rows_per_head``: token plans, the most tokens of one example that selected each head ``(H,)``.
    ``shared_heads``: sequence plans in which every example chose the same heads, those heads (else None).
    ``work_fraction``: share of the dense block's (query row, head) work the gathered path will compute.
    ``every_row_active``: token plans in which every (example, token) row chose at least one head.
    ``head_sets``: token plans with at most ``MAX_SET_HEADS`` heads and large enough for the per-set path,
    ``(heads as a bit mask, rows)`` of every distinct head set the (example, token) rows chose, ascending by mask
    (empty otherwise).
    """

    granularity: str
    buckets: tuple[tuple[int, int, int], ...] = ()
    rows_per_head: tuple[int, ...] = ()
    work_fraction: float = 1.0
    shared_heads: tuple[int, ...] | None = None
    every_row_active: bool = False
    head_sets: tuple[tuple[int, int], ...] = ()


def kv_active(plan_active: Tensor, num_kv_heads: int) -> Tensor:
    """``(..., Hkv)`` bool: key/value heads that some active query head uses."""
    H = plan_active.shape[-1]
    return plan_active.unflatten(-1, (num_kv_heads, H // num_kv_heads)).any(-1)


def gather_sizes(weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> GatherSizes:
    """Read back the sizes that shape the packed tensors (one host synchronisation)."""
    L = weights.layout
    H, Hkv = L.num_heads, L.num_kv_heads
    if plan.granularity == "sequence":
        counts = plan.counts.long()  # (B,)
        kvc = kv_active(plan.active, Hkv).sum(-1) if L.group_size > 1 else counts  # (B,)
        B = plan.gates.shape[0]
        hist = torch.bincount(counts * (Hkv + 1) + kvc, minlength=(H + 1) * (Hkv + 1))
        same = (plan.active == plan.active[:1]).all().view(1) if B else hist.new_zeros(1)
        first = plan.active[0] if B else plan.active.new_zeros(H)
        read = torch.cat([hist, same.long(), first.long()]).tolist()  # the one device -> host read
        n_hist = (H + 1) * (Hkv + 1)
        buckets = tuple((key // (Hkv + 1), key % (Hkv + 1), n) for key, n in enumerate(read[:n_hist]) if n)
        shared = tuple(h for h in range(H) if read[n_hist + 1 + h]) if read[n_hist] else None
        work = sum(k * n for k, _, n in buckets) / max(B * H, 1)
        return GatherSizes("sequence", buckets=buckets, work_fraction=work, shared_heads=shared)
    T = plan.gates.shape[1]
    if not plan.gates.shape[0]:
        return GatherSizes("token", rows_per_head=(0,) * H, work_fraction=0.0)
    every = (plan.counts > 0).all().view(1).long()
    parts = [plan.active.sum(1).amax(0), every]  # (H,) + 1
    from condcomp.executors import gathered_token

    # + (2**H,): how many rows chose each head set; skipped where even one set of every row would be too small
    # for the per-set path (its size rule, gathered_token.MIN_SET_WORK)
    if H <= MAX_SET_HEADS and inputs.x.numel() >= gathered_token.MIN_SET_WORK:  # B*T*D bounds rows per set x D
        parts.append(torch.bincount(head_set_keys(plan.active).reshape(-1), minlength=2 ** H))
    read = torch.cat(parts).tolist()  # the one device -> host read
    rows, every_row = read[:H], read[H]
    sets = tuple((key, n) for key, n in enumerate(read[H + 1:]) if n)
    return GatherSizes("token", rows_per_head=tuple(rows), work_fraction=sum(rows) / max(H * T, 1),
                       every_row_active=bool(every_row), head_sets=sets)


def head_set_keys(active: Tensor) -> Tensor:
    """``(..., H)`` bool -> ``(...)`` int64: the chosen heads as a bit mask (bit h = head h)."""
    bits = torch.ones((), dtype=torch.long, device=active.device) << torch.arange(
        active.shape[-1], device=active.device)
    return (active.long() * bits).sum(-1)


def _project(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``x (n, T, D) @ w (n, F, D)^T (+ b (n, F))`` -> ``(n, T, F)``."""
    if b is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


def _bucket_mask(mask: AttentionMask, idx: Tensor | None, heads: Tensor) -> tuple[Tensor | None, Tensor | None]:
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


def _sequence_bucket(
    w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, mask: AttentionMask,
    idx: Tensor | None, k: int, kkv: int, fused_w: tuple[Tensor, Tensor | None] | None,
) -> Tensor:
    """Output ``(n, T, D)`` (output bias included) of the examples ``idx`` (None = all) that use ``k`` heads."""
    L = w.layout
    H, Hkv, Dh, G = L.num_heads, L.num_kv_heads, L.head_dim, L.group_size

    def pick(t: Tensor) -> Tensor:
        # index_select copies whole contiguous rows; advanced indexing (t[idx]) was 3-6x slower here (measured
        # with libgomp's default wait policy, docs/performance.md)
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
        qkv = _project(x, rows.index_select(0, qkv_ix).view(n, k * 3 * Dh, -1), bias)  # (n, T, k*3*Dh)
        q, kk, v = qkv.view(n, T, k, 3, Dh).permute(3, 0, 2, 1, 4).unbind(0)  # each (n, k, T, Dh)
    else:
        q_bias = None if w.q_bias is None else w.q_bias.view(H, Dh).index_select(0, flat_heads).view(n, k * Dh)
        q = _project(x, per_head(w.q_weight, H, Dh).index_select(0, flat_heads).view(n, k * Dh, -1), q_bias)
        q = q.view(n, T, k, Dh).transpose(1, 2)  # (n, k, T, Dh)
        kv_heads = heads if G == 1 else pick(torch.argsort((~kv_active(plan.active, Hkv)).byte(), dim=1, stable=True))
        kv_heads = kv_heads[:, :kkv]  # (n, kkv) the key/value heads this bucket needs, ascending
        if inputs.key_states is not None and inputs.value_states is not None:
            b = torch.arange(n, device=x.device).unsqueeze(1)
            kk, v = pick(inputs.key_states)[b, kv_heads], pick(inputs.value_states)[b, kv_heads]  # (n, kkv, S, Dh)
        else:
            flat_kv = kv_heads.reshape(-1)  # (n*kkv,)
            kk, v = (
                _project(pick(src), per_head(wt, Hkv, Dh).index_select(0, flat_kv).view(n, kkv * Dh, -1),
                         None if bt is None else bt.view(Hkv, Dh).index_select(0, flat_kv).view(n, kkv * Dh))
                .view(n, -1, kkv, Dh).transpose(1, 2)  # (n, kkv, S, Dh)
                for src, wt, bt in ((inputs.key_input, w.k_weight, w.k_bias),
                                    (inputs.value_input, w.v_weight, w.v_bias))
            )
    if inputs.rotary is not None:
        cos, sin = (pick(t) for t in inputs.rotary)  # (n, T, Dh)
        q = apply_rotary(q, cos, sin)
        if inputs.key_states is None:
            kk = apply_rotary(kk, cos, sin)
    if fused_w is None and G > 1:  # each query head reads its key/value head's slot among the kkv computed ones
        slot = (torch.cumsum(kv_active(plan.active, Hkv).long(), 1) - 1)  # (B, Hkv)
        slot = pick(slot).gather(1, torch.div(heads, G, rounding_mode="floor"))  # (n, k)
        ix = slot[:, :, None, None].expand(n, k, kk.shape[2], Dh)
        kk, v = kk.gather(1, ix), v.gather(1, ix)  # (n, k, S, Dh)
    attn_mask, dead = _bucket_mask(mask, idx, heads)
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


def grouped_gemm_runs(w: AttentionWeights, inputs: AttentionInputs) -> bool:
    """Whether this call can take the grouped-GEMM path: CPU, float32/float64 (MKL's batch GEMMs), no autocast,
    and every input, cache and weight in the query input's dtype."""
    x = inputs.x
    tensors = [inputs.key, inputs.value, inputs.key_states, inputs.value_states, w.q_weight, w.k_weight,
               w.v_weight, w.o_weight]
    return (grouped_gemm.available(x) and not torch.is_autocast_enabled(x.device.type)
            and all(t.dtype == x.dtype and t.device == x.device for t in tensors if t is not None))


def sequence_gathered(w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, sizes: GatherSizes) -> Tensor:
    """``(B, T, D)`` for a sequence plan: each bucket of equal ``(k, k_kv)`` runs as one batched block."""
    x = inputs.x
    B, T, _ = x.shape
    D = w.o_weight.shape[0]
    L = w.layout
    mask = build_attention_mask(inputs, L.causal, x.dtype)
    fused = inputs.key is None and inputs.value is None and inputs.key_states is None and L.group_size == 1
    Hkv = L.num_kv_heads
    pairs = sum(k * n for k, _, n in sizes.buckets)
    if sizes.shared_heads:  # one head set for the whole batch: a plain k-head block on shared weight slices
        from condcomp.executors.gathered_token import shared_set

        return zero_dead_rows(shared_set(w, inputs, plan, mask, list(sizes.shared_heads)), dead_rows(mask, B, T))
    one_bucket = len(sizes.buckets) == 1 and sizes.buckets[0][0] > 0
    weights_copied = pairs * 3 * L.head_dim * x.shape[-1]  # what one bucket's block would gather
    if pairs > 0 and grouped_gemm_runs(w, inputs) and (not one_bucket or weights_copied >= MIN_GROUPED_COPY):
        # CPU with MKL: grouped GEMMs read the pairs' input rows and weight blocks in place (no copies at all)
        return sequence_pairs_grouped(w, inputs, plan, mask, pairs)
    fused_w = qkv_head_rows(w) if fused else None  # only now: the grouped path makes its own (separate q/k/v: a copy)
    if one_bucket:  # one shape of work: no gather of examples at all
        k, kkv, _ = sizes.buckets[0]
        y = _sequence_bucket(w, inputs, plan, mask, None, k, kkv, fused_w)
    elif fused and pairs > 0 and PACK_PAIRS:  # variable k: one packed block instead of one block per bucket
        return sequence_pairs(w, inputs, plan, mask, pairs, max(k for k, _, _ in sizes.buckets))
    else:
        key = plan.counts.long() * (Hkv + 1)
        key = key + (kv_active(plan.active, Hkv).sum(-1) if L.group_size > 1 else plan.counts.long())
        perm = torch.argsort(key, stable=True)  # (B,) examples sorted by bucket
        y = x.new_zeros(B, T, D) if sizes.buckets and sizes.buckets[0][0] == 0 else x.new_empty(B, T, D)
        start = 0
        for k, kkv, n in sizes.buckets:
            idx = perm[start:start + n]
            start += n
            if k > 0:  # rows of k = 0 examples stay exactly zero (no bias either)
                part = _sequence_bucket(w, inputs, plan, mask, idx, k, kkv, fused_w)  # autocast: maybe bf16
                y.index_copy_(0, idx, part.to(y.dtype))
        y = keep_gates_in_graph(y, plan)  # every k = 0: zero output, still in the graph
    return zero_dead_rows(y, dead_rows(mask, B, T))


@register_executor("gathered")
class GatheredExecutor:
    """Computes only the selected heads: the work scales with the number of (row, head) pairs chosen.

    Sequence plans run as grouped GEMMs over the selected (example, head) pairs on CPU (float32/float64, no
    copies), elsewhere as batched matmuls per bucket of equal head count (no padding); token plans gather
    each head's selected tokens (padding bounded by the spread of per-example counts). Same semantics as the
    ``reference`` executor: outputs and gradients agree with it. One host synchronisation per call for sizing.

    >>> import torch, condcomp
    >>> from condcomp.executors import get_executor
    >>> get_executor("gathered").name
    'gathered'
    """

    name = "gathered"
    granularities = ("sequence", "token")

    def supports(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> str | None:
        if plan.granularity not in self.granularities:
            return f"granularity {plan.granularity!r} is not one of {self.granularities}"
        if inputs.x.dtype not in _FLOAT_DTYPES:
            return f"dtype {inputs.x.dtype} is not a floating dtype it supports ({_FLOAT_DTYPES})"
        if weights.q_weight.dtype != inputs.x.dtype:
            return (f"weights are {weights.q_weight.dtype} but the input is {inputs.x.dtype}; cast the model "
                    "or the input so they match")
        return None

    def sizes(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> GatherSizes:
        """The packed sizes of this call (one host synchronisation); pass them to :meth:`run` to reuse them."""
        return gather_sizes(weights, inputs, plan)

    def run(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
            sizes: GatherSizes | None = None) -> Tensor:
        """``(B, T, D)``; ``sizes`` from :meth:`sizes` when the caller already read them back."""
        if sizes is None:
            sizes = gather_sizes(weights, inputs, plan)
        if plan.granularity == "sequence":
            return sequence_gathered(weights, inputs, plan, sizes)
        from condcomp.executors.gathered_token import token_gathered

        return token_gathered(weights, inputs, plan, sizes)

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        return self.run(weights, inputs, plan)
