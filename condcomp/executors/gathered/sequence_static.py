"""``sequence.static``: the capturable sequence strategy: no device -> host read, shapes fixed before the call.

Every example computes ``k_cap`` heads (``HeadPlan.k_cap``, the bound the budget policy declares; H without one):
its selected heads ``order[:, :k_cap]``, padded with unselected heads whose gate is 0. One batched block over the
whole batch (sequence.py's ``bucket_block``): ``index_select`` of the heads' weight blocks, ``bmm`` for q/k/v, one SDPA
over ``(B, k_cap, T, Dh)``, ``bmm`` for the output projection. Nothing depends on the plan's values, so
``torch.compile(fullgraph=True)`` and CUDA graphs capture it; the price is the padding, ``k_cap / H`` of the dense
work whatever the plan selects (dense cost without a cap). It runs where the call is not sized (under
``torch.compile`` on any device, and with ``tuning.static_sequence``, on by default for CUDA).
"""

from __future__ import annotations

import torch
from torch import Tensor
from typing_extensions import override

from condcomp.executors.base import keep_gates_in_graph, qkv_head_rows, zero_dead_rows
from condcomp.executors.gathered.call import GatheredCall, Strategy
from condcomp.executors.gathered.sequence import bucket_block, fused_layout
from condcomp.masks import build_attention_mask, dead_rows
from condcomp.types import HeadPlan


def check_cap(plan: HeadPlan) -> None:
    """Fail, on the device and without a host read, when a row selects more heads than the plan's ``k_cap``
    (those heads would be dropped: a wrong answer, not a slower one)."""
    if plan.k_cap is not None and plan.k_cap < plan.num_heads:
        torch._assert_async((plan.counts <= plan.k_cap).all(),
                            f"a sequence plan selects more heads than its k_cap = {plan.k_cap} (HeadPlan.k_cap: the "
                            "bound its budget policy declared); build the plan with a k_cap that bounds its counts")


def over_cap(plan: HeadPlan) -> str | None:
    """What is wrong when an example of ``plan`` selects more heads than its ``k_cap`` (a host read: for
    ``explain``)."""
    if plan.k_cap is None or plan.k_cap >= plan.num_heads or plan.counts.numel() == 0:
        return None
    most = int(plan.counts.max())
    if most <= plan.k_cap:
        return None
    return (f"the plan is over its cap: an example chose {most} heads, more than its k_cap = {plan.k_cap} "
            "(HeadPlan.k_cap: the bound its budget policy declared), so this strategy refuses the call; build the "
            "plan with a k_cap that bounds its counts, or run a sized strategy (outside torch.compile)")


def padded_plan(plan: HeadPlan, cap: int) -> HeadPlan:
    """The plan widened to exactly ``cap`` heads per example: its selected heads plus the first unselected ones
    (``order[:, :cap]``) are "active", and the added heads' gates are 0, so they change no output or gradient."""
    B, H = plan.gates.shape
    taken = torch.zeros(B, H, dtype=torch.bool, device=plan.order.device).scatter(1, plan.order[:, :cap], True)
    gates = plan.gates.masked_fill(~plan.active, 0.0)  # (B, H) zero on every added head, whoever built the plan
    return HeadPlan("sequence", gates, taken, plan.counts, plan.order, {}, cap)


class Static(Strategy):
    name, granularity = "sequence.static", "sequence"
    needs_sizes = False

    @override
    def run(self, call: GatheredCall) -> Tensor:
        w, inputs, plan = call.weights, call.inputs, call.plan
        x = inputs.x
        B, T, _ = x.shape
        cap = plan.head_cap
        check_cap(plan)
        if cap == 0 or B == 0:  # no head anywhere: exactly zero, still joined to the gates' graph
            return keep_gates_in_graph(x.new_zeros(B, T, w.o_weight.shape[0]), plan)
        # one fused q/k/v matmul in eager mode; under compile q, k and v are projected apart: finding out whether
        # they are slices of one in-projection reads data pointers, which dynamo cannot trace
        fused_w = qkv_head_rows(w) if fused_layout(call) and not torch.compiler.is_compiling() else None
        kkv = min(cap, w.layout.num_kv_heads)  # the key/value heads k_cap query heads can read
        # the mask built here, not call.mask: a cached_property takes a lock on Python 3.11, which dynamo cannot trace
        mask = build_attention_mask(inputs, w.layout.causal, x.dtype)
        y = bucket_block(w, inputs, padded_plan(plan, cap), mask, None, cap, kkv, fused_w)  # (B, T, D)
        if w.o_bias is not None:  # the output bias only on rows that computed a head (k = 0 rows: exactly zero)
            y = y.masked_fill((plan.counts == 0)[:, None, None], 0.0)
        return zero_dead_rows(y, dead_rows(mask, B, T))
