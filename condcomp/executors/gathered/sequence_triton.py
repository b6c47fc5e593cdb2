"""Sequence strategy ``sequence.triton``: the selected (example, head) pairs through the Triton pair ops, no host read.

Each example's heads are ``plan.order[:, :C]`` with the cap ``C`` = ``plan.head_cap`` (the ``k_cap`` its budget policy
declares, H without one), its count ``plan.counts``. Queries, keys and values come from
``torch.ops.condcomp.pair_project`` (DejaVu's ``qkv_proj_sparse`` pattern: a grid fixed by ``C``, head ids read inside
the kernel, weights read in place, pairs past an example's count written as zeros); one SDPA call runs over
``(B, C, T, Dh)`` with the masks, causal flag, rotary, head norms and GQA of sequence.py; the output projection is
``torch.ops.condcomp.pair_output`` (DejaVu's ``out_proj_sparse``: the loop over the example's heads inside one program,
gates applied, the output bias only on rows with a head). With GQA, keys and values are projected once per example
and key/value head it uses (its used groups first), then gathered per query head.

Every shape is fixed by ``B, T, H``: no ``.item()``, no ``tolist()``, no bucketing; the ops have fake implementations,
so ``torch.compile(fullgraph=True)`` and CUDA graphs capture the strategy. It runs on CUDA with triton installed
(``pip install 'condcomp[gpu]'``); ``GatheredTuning.pair_kernels_on_cpu`` lets it run on CPU too (the ops' torch
fallback, or the kernels under ``TRITON_INTERPRET=1``): for the tests. Padded pairs cost attention FLOPs over the
cap (SDPA runs on all ``C`` slots) but no projection FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from condcomp.executors.base import per_head, zero_dead_rows
from condcomp.executors.gathered.call import GatheredCall, Strategy
from condcomp.executors.gathered.pairs import call_rejections, ops
from condcomp.executors.gathered.sequence import bucket_mask
from condcomp.masks import build_attention_mask, dead_rows
from condcomp.plans import kv_groups_used
from condcomp.rotary import apply_rotary


def _keys_values(call: GatheredCall, heads: Tensor, counts: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Keys and values ``(B, C, S, Dh)`` of each pair's key/value head (normalised, not yet rotated): from the
    cache, or projected once per key/value head an example uses (GQA: used groups first), then gathered per pair."""
    w, inputs, plan = call.weights, call.inputs, call.plan
    Hkv, Dh, G = w.layout.num_kv_heads, w.layout.head_dim, w.layout.group_size
    B, C = heads.shape
    if inputs.key_states is not None and inputs.value_states is not None:
        b = torch.arange(B, device=heads.device).unsqueeze(1)  # (B, 1)
        return inputs.key_states[b, heads // G].to(dtype), inputs.value_states[b, heads // G].to(dtype)
    kv_heads, kv_counts = heads, counts  # without GQA: the query heads' own key/value heads
    if G > 1:  # each used key/value head once, used first, ascending
        used = kv_groups_used(plan.active, Hkv)  # (B, Hkv)
        kv_heads = torch.argsort((~used).byte(), dim=1, stable=True)  # (B, Hkv)
        kv_counts = used.sum(-1)
    kk, v = (ops.pair_project(src.to(dtype), per_head(wt, Hkv, Dh).to(dtype),
                              None if bt is None else bt.view(Hkv, Dh).to(dtype), kv_heads, kv_counts)
             for src, wt, bt in ((inputs.key_input, w.k_weight, w.k_bias),
                                 (inputs.value_input, w.v_weight, w.v_bias)))  # (B, C|Hkv, S, Dh)
    kk = w.norm_keys(kk)
    if G > 1:  # each query head reads its key/value head's slot among those computed
        slot = torch.cumsum(used.long(), 1) - 1  # (B, Hkv)
        slot = slot.gather(1, torch.div(heads, G, rounding_mode="floor")).clamp(min=0)  # (B, C)
        ix = slot[:, :, None, None].expand(B, C, kk.shape[2], Dh)
        kk, v = kk.gather(1, ix), v.gather(1, ix)  # (B, C, S, Dh)
    return kk, v


class PairKernels(Strategy):
    name, granularity = "sequence.triton", "sequence"
    needs_sizes = False  # fixed shapes from the plan's cap: it runs calls sized without a host read

    @override
    def supports(self, call: GatheredCall) -> list[str]:
        if not call.tuning.pair_kernels:
            return ["tuning.pair_kernels is off"]
        if call.plan.head_cap == 0:
            return ["the plan's k_cap is 0: no head anywhere (sequence.static returns the exact zeros)"]
        return call_rejections(call)

    def cap(self, call: GatheredCall) -> int:
        """``C``, the head slots per example: the plan's ``k_cap`` (the bound its budget policy declares; H without
        one). An example that chose more heads is refused (on the device: an assert), never silently dropped."""
        return call.plan.head_cap

    def over_cap(self, call: GatheredCall, C: int, k: str) -> str:
        """What was wrong when an example chose ``k`` heads, more than the ``C`` slots, and what to do."""
        plan = call.plan
        where = (f"the plan's k_cap = {plan.k_cap} (HeadPlan.k_cap: the bound its budget policy declared, "
                 "Budget.k_cap)" if plan.k_cap == C else f"{type(self).__name__}.cap()")
        return (f"{self.name}: an example chose {k} heads, over the cap of {C} head slots per example from {where}; "
                "a head past the cap would be dropped. Make the cap bound the plan's counts (a budget policy "
                "declaring a k_cap at least the k it asks, e.g. budgetformer with cap_at_s_max=True, and a router "
                "selecting at most the budget's k), or run a strategy that reads the counts "
                "(GatheredExecutor(strategy=\"sequence.buckets\"), outside torch.compile)")

    @override
    def run(self, call: GatheredCall) -> Tensor:
        w, inputs, plan = call.weights, call.inputs, call.plan
        L = w.layout
        H, Dh = L.num_heads, L.head_dim
        x = inputs.x
        B, T, _ = x.shape
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype

        C = self.cap(call)  # fixed shapes whatever k each example chose
        if not 1 <= C <= H:
            raise ValueError(f"{self.name}: the cap must lie in [1, H = {H}], got {C}")
        heads = plan.order[:, :C].long()  # (B, C) selected heads first, ascending
        counts = plan.counts.long()  # (B,)
        if C < H:  # a head past the cap would be dropped: a wrong answer, so refused
            if x.device.type == "cpu" and not torch.compiler.is_compiling():  # a host read costs nothing here
                k = int(counts.max())
                if k > C:
                    raise ValueError(self.over_cap(call, C, str(k)))
            else:  # on the device, no host read: the message cannot name the k
                torch._assert_async((counts <= C).all(), self.over_cap(call, C, "more"))
        gates = plan.gates.gather(1, heads)  # (B, C), zero past each count
        with torch.autocast(x.device.type, enabled=False):
            q_bias = None if w.q_bias is None else w.q_bias.view(H, Dh).to(dtype)
            q = ops.pair_project(x.to(dtype), per_head(w.q_weight, H, Dh).to(dtype), q_bias, heads,
                                 counts)  # (B, C, T, Dh)
            kk, v = _keys_values(call, heads, counts, dtype)  # (B, C, S, Dh) each
            q = w.norm_queries(q)
            if inputs.rotary is not None:
                cos, sin = inputs.rotary  # (B, T, Dh)
                q = apply_rotary(q, cos.to(dtype), sin.to(dtype))
                if inputs.key_states is None:
                    kk = apply_rotary(kk, cos.to(dtype), sin.to(dtype))
            # built here, not read from call.mask: a cached_property takes a lock that torch.compile cannot trace
            full_mask = build_attention_mask(inputs, L.causal, x.dtype)
            mask, dead = bucket_mask(full_mask, None, heads)  # (B|1, C|1, T|1, S), (B|1, C|1, T|1)
            if mask is not None and mask.is_floating_point():
                mask = mask.to(dtype)  # an additive mask in the computation's dtype, as SDPA needs
            out = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, dropout_p=inputs.dropout_p,
                                                 is_causal=full_mask.is_causal, scale=L.scale)  # (B, C, T, Dh)
            if dead is not None:
                out = out.masked_fill(dead.unsqueeze(-1), 0.0)
            o_bias = None if w.o_bias is None else w.o_bias.to(dtype)
            y = ops.pair_output(out, w.o_weight.to(dtype), gates, heads, counts, o_bias)  # (B, T, D)
        return zero_dead_rows(y.to(x.dtype), dead_rows(full_mask, B, T))
