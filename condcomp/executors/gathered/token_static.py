"""The capturable token strategies (MoH): no device -> host read, every shape fixed by B, T, H and what the plan
declares before the call.

A token plan declares ``shared_heads`` (S: the first heads, which every real token chooses) and ``k_cap`` (the most
heads a token chooses), so each token has at most ``R = k_cap - S`` routed heads: ``B*T*R`` routed (token, head)
pairs, a host constant (MoH: ``R`` is the router's ``top_k`` at the full budget). A token that chose more routed
heads fails on the device (``torch._assert_async``), never silently; a token that skipped a shared head is exact
(its gate is 0, so computing it adds nothing).

- ``token.triton`` (the Triton pair ops, opt-in as ``sequence.triton`` is): the shared heads as one dense block; the
  routed pairs' query projections through ``torch.ops.condcomp.pair_project`` with the tokens as its examples (one
  row each, ``R`` head slots; pairs/row_kernels.py sorts the pairs by head and gives each block of one head's pairs
  one weight tile), their attention, and their gated output projection through ``torch.ops.condcomp.pair_output``.
  Attention (no dropout): only the pairs' rows, ``torch.ops.condcomp.pair_row_attention``, in training too (its
  backward recomputes the probabilities from the saved log-sum-exp: ``dq`` per block of sorted rows, ``dk``/``dv``
  per (example, KV head, key block)); with dropout or an attention bias that asks for a gradient: each pair's query
  in its head's slot of a ``(B, E, T, Dh)`` block that one SDPA call attends (dense over the routed heads). Weight
  gradients: pairs sorted by head once on the device, one program per head tile (no atomics: deterministic).
- ``token.static`` (torch only, where the kernels do not run): one dense block of the shared heads, plus every
  routed head when a token may choose one (``R > 0``), each (token, head) output multiplied by its gate (0 where the
  token did not choose the head): the masked executor's arithmetic, dense cost, capturable.

Keys and values are dense (a later token may choose any head, so every head's keys are needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from condcomp.executors.base import add_output_bias, keep_gates_in_graph, per_head, zero_dead_rows
from condcomp.executors.gathered.blocks import heads_block, project_heads
from condcomp.executors.gathered.call import GatheredCall, Strategy
from condcomp.executors.gathered.pairs import call_rejections, ops
from condcomp.masks import AttentionMask, build_attention_mask, dead_rows
from condcomp.rotary import rotate_half
from condcomp.types import HeadPlan


def token_shape(plan: HeadPlan) -> tuple[int, int]:
    """``(S, R)``: the plan's shared heads and its routed slots per token (``k_cap - S``, at most ``H - S``)."""
    H, S = plan.num_heads, plan.shared_heads
    return S, min(max(plan.head_cap - S, 0), H - S)


def check_routed(plan: HeadPlan, S: int, R: int) -> None:
    """Fail on the device, without a host read, when a token chose more routed heads than ``R`` (they would be
    dropped: a wrong answer, not a slower one)."""
    if R < plan.num_heads - S:
        torch._assert_async((plan.active[..., S:].sum(-1) <= R).all(),
                            f"a token plan chose more than k_cap - shared_heads = {R} routed heads for a token "
                            f"(HeadPlan.k_cap = {plan.k_cap}, shared_heads = {S}); build the plan with a k_cap that "
                            "bounds every token's heads")


def routed_over_cap(plan: HeadPlan) -> str | None:
    """What is wrong when a token of ``plan`` chose more routed heads than ``R`` (a host read: for ``explain``)."""
    S, R = token_shape(plan)
    if R >= plan.num_heads - S or plan.active.numel() == 0:
        return None
    most = int(plan.active[..., S:].sum(-1).max())
    if most <= R:
        return None
    return (f"the plan is over its cap: a token chose {most} routed heads, more than k_cap - shared_heads = {R} "
            f"(HeadPlan.k_cap = {plan.k_cap}, shared_heads = {S}), so this strategy refuses the call; build the plan "
            "with a k_cap that bounds every token's heads, or run a sized strategy (outside torch.compile)")


def _heads_from(t: Tensor | None, first: int, count: int) -> Tensor | None:
    """Dim 1 of a mask-like ``(B|1, H|1, ...)`` tensor restricted to heads ``first .. first + count - 1``."""
    return t if t is None or t.shape[1] == 1 else t[:, first:first + count]


def _kv_of(t: Tensor, first: int, count: int, group: int) -> Tensor:
    """``(B, count, S, Dh)``: the key/value head of each query head ``first .. first + count - 1`` (GQA groups)."""
    if group == 1:
        return t[:, first:first + count]
    return t.index_select(1, torch.div(torch.arange(first, first + count, device=t.device), group,
                                       rounding_mode="floor"))


def _block(call: GatheredCall, mask: AttentionMask, n: int, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """``(B, T, D)`` of heads ``0 .. n - 1`` as one dense block, gated per token (no output bias)."""
    gates = call.plan.gates[..., :n].transpose(1, 2).unsqueeze(-1)  # (B, n, T, 1)
    G = call.weights.layout.group_size
    return heads_block(call.weights, call.inputs, mask, list(range(n)), q, _kv_of(keys, 0, n, G),
                       _kv_of(values, 0, n, G), gates, None)


def _finish(call: GatheredCall, y: Tensor, mask: AttentionMask) -> Tensor:
    B, T, _ = call.inputs.x.shape
    y = add_output_bias(keep_gates_in_graph(y, call.plan), call.weights, call.plan)
    return zero_dead_rows(y, dead_rows(mask, B, T))


class Static(Strategy):
    name, granularity = "token.static", "token"
    needs_sizes = False

    @override
    def run(self, call: GatheredCall) -> Tensor:
        w, inputs, plan = call.weights, call.inputs, call.plan
        x = inputs.x
        S, R = token_shape(plan)
        check_routed(plan, S, R)
        n = plan.num_heads if R > 0 else S  # no routed pair possible: the shared heads alone
        # the mask built here, not call.mask: a cached_property takes a lock on Python 3.11, which dynamo cannot trace
        mask = build_attention_mask(inputs, w.layout.causal, x.dtype)
        if n == 0:
            return _finish(call, x.new_zeros(*x.shape[:2], w.o_weight.shape[0]), mask)
        q, keys, values = project_heads(w, inputs, list(range(n)), list(range(w.layout.num_kv_heads)))
        return _finish(call, _block(call, mask, n, q, keys, values), mask)


class Pairs(Strategy):
    name, granularity = "token.triton", "token"
    needs_sizes = False

    @override
    def supports(self, call: GatheredCall) -> list[str]:
        if not call.tuning.pair_kernels:
            return ["tuning.pair_kernels is off"]
        S, R = token_shape(call.plan)
        if R == 0:
            return [f"no routed pair (k_cap - shared_heads = 0): token.static runs the {S} shared heads"]
        return call_rejections(call)

    @override
    def run(self, call: GatheredCall) -> Tensor:
        w, inputs, plan = call.weights, call.inputs, call.plan
        x = inputs.x
        B, T, D_in = x.shape
        H, Dh, G = w.layout.num_heads, w.layout.head_dim, w.layout.group_size
        S, R = token_shape(plan)
        E = H - S
        check_routed(plan, S, R)
        mask = build_attention_mask(inputs, w.layout.causal, x.dtype)
        q_s, keys, values = project_heads(w, inputs, list(range(S)), list(range(w.layout.num_kv_heads)))
        y = _block(call, mask, S, q_s, keys, values) if S else x.new_zeros(B, T, w.o_weight.shape[0])
        # (B, T, R): each token's routed heads (positions among the E routed ones), chosen first, ascending
        chosen = plan.active[..., S:]
        slot = torch.argsort((~chosen).to(torch.uint8), dim=-1, stable=True)[..., :R]
        counts = chosen.sum(-1).clamp(max=R).reshape(B * T).long()  # (B*T,)
        heads = (slot + S).reshape(B * T, R)  # (B*T, R) head ids
        # the ops take one dtype: autocast's where it is on (custom ops are not autocast), else the input's
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        q_bias = None if w.q_bias is None else w.q_bias.view(H, Dh).to(dtype)
        q = ops.pair_project(x.reshape(B * T, 1, D_in).to(dtype), per_head(w.q_weight, H, Dh).to(dtype), q_bias,
                             heads, counts)  # (B*T, R, 1, Dh), zeros past each token's count
        q = w.norm_queries(q.view(B, T, R, Dh))
        if inputs.rotary is not None:
            cos, sin = (t.unsqueeze(2).to(q.dtype) for t in inputs.rotary)  # (B, T, 1, Dh)
            q = q * cos + rotate_half(q) * sin
        full_mask = mask.mask
        if full_mask is not None and full_mask.is_floating_point():
            full_mask = full_mask.to(q.dtype)  # an additive mask in the computation's dtype, as SDPA needs
        mask_grad = full_mask is not None and full_mask.requires_grad and torch.is_grad_enabled()
        if inputs.dropout_p == 0.0 and not mask_grad:  # only the pairs' rows attend, forward and backward
            o, _ = ops.pair_row_attention(q, keys.to(q.dtype), values.to(q.dtype), full_mask, slot,
                                          counts.view(B, T), S, E, G, mask.is_causal, w.layout.scale)  # (B, T, R, Dh)
        else:  # dropout or a trained attention bias: each pair's query in its head's slot of one dense block
            ix = slot.unsqueeze(-1).expand(B, T, R, Dh)
            q = q.new_zeros(B, T, E, Dh).scatter(2, ix, q).transpose(1, 2)  # (B, E, T, Dh)
            out = F.scaled_dot_product_attention(q, _kv_of(keys, S, E, G), _kv_of(values, S, E, G),
                                                 attn_mask=_heads_from(full_mask, S, E), dropout_p=inputs.dropout_p,
                                                 is_causal=mask.is_causal, scale=w.layout.scale)  # (B, E, T, Dh)
            o = out.transpose(1, 2).gather(2, ix)  # (B, T, R, Dh): each pair's attention output
        dead = _heads_from(mask.dead, S, E)
        if dead is not None:  # (B|1, E|1, T|1): rows with no key to attend, exactly zero
            dead = dead.expand(B, E, T).transpose(1, 2).gather(2, slot)  # (B, T, R)
            o = o.masked_fill(dead.unsqueeze(-1), 0.0)
        gates = plan.gates.gather(-1, slot + S).reshape(B * T, R)  # zero past each token's count
        y_r = ops.pair_output(o.reshape(B * T, R, 1, Dh).to(dtype), w.o_weight.to(dtype), gates, heads, counts,
                              None)  # (B*T, 1, D)
        return _finish(call, y + y_r.view(B, T, y.shape[-1]).to(y.dtype), mask)
