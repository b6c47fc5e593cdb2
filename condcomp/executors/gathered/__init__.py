"""The gathered-sparse executor: only the selected (example, head) or (token, head) pairs are computed.

Read it in this order: tuning.py (every threshold, per device), sizing.py (the one device -> host read), call.py
(the sized call and what a strategy is), strategies.py (the dispatch table: which strategy runs which call), then
the strategies: sequence.py (with sequence_grouped.py), sequence_static.py (the capturable path: no host read),
token.py and token_static.py (its capturable paths), built from the shared blocks in blocks.py.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from condcomp.executors.gathered.call import GatheredCall, Strategy
from condcomp.executors.gathered.sequence_static import over_cap
from condcomp.executors.gathered.sizing import GatherSizes, gather_sizes, head_set_keys, static_sizes
from condcomp.executors.gathered.strategies import STRATEGIES, Table, choose, get_strategy, rejections, strategy_names
from condcomp.executors.gathered.token_static import routed_over_cap
from condcomp.executors.gathered.tuning import CPU, CUDA, GatheredTuning, tuning_for
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

__all__ = ["CPU", "CUDA", "STRATEGIES", "GatherSizes", "GatheredCall", "GatheredExecutor", "GatheredTuning",
           "Prepared", "Strategy", "gather_sizes", "get_strategy", "head_set_keys", "static_sizes", "strategy_names",
           "tuning_for"]

logger = logging.getLogger("condcomp")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The cost reported where the tuning says dense attention is faster: just above masked's 1.0, so that auto runs
# masked when it can and gathered (already sized, no second read) when masked cannot run the call.
DENSE_IS_FASTER = 1.01


class Prepared:
    """A call sized by :meth:`GatheredExecutor.prepare`, its strategy chosen: calling it runs the chosen strategy.
    ``strategy`` is that strategy's name (what ``HeadUsage.strategy`` reports)."""

    def __init__(self, call: GatheredCall, chosen: Strategy, name: str = "gathered") -> None:
        self.call, self.chosen, self.strategy, self.name = call, chosen, chosen.name, name

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        call = self.call
        if weights is not call.weights or inputs is not call.inputs or plan is not call.plan:  # same sizes
            call = GatheredCall(weights, inputs, plan, call.sizes, call.tuning)
        return self.chosen.run(call)


@register_executor("gathered")
class GatheredExecutor:
    """Computes only the selected heads: the work scales with the number of (row, head) pairs chosen.

    Each call is sized once (one host synchronisation) and run by the first strategy of the dispatch table
    (:data:`condcomp.executors.gathered.STRATEGIES`) that can run it. A sequence plan under ``torch.compile`` (any
    device), or where ``tuning.static_sequence`` is set (CUDA), is not sized: it runs ``sequence.static``, which
    reads nothing back and computes the plan's ``k_cap`` heads per example; a token plan there
    (``tuning.static_token`` on CUDA) runs ``token.static`` or ``token.triton``: its shared heads as one dense block,
    its routed (token, head) pairs bounded by ``k_cap``. Same semantics as the ``reference``
    executor: outputs and gradients agree with it. ``tuning``: thresholds (default: those of the call's device);
    ``strategy``: run only this strategy (an error names why it cannot run a call), for tests and A/B timing;
    ``strategies``: the dispatch table (default :data:`STRATEGIES`; docs/extending.md adds a strategy).

    >>> from condcomp.executors import get_executor
    >>> get_executor("gathered").name
    'gathered'
    >>> GatheredExecutor(strategy="sequence.buckets").strategy
    'sequence.buckets'
    """

    name = "gathered"
    granularities = ("sequence", "token")
    capabilities = Capabilities(dtypes=_FLOAT_DTYPES, skips_work=True)

    def __init__(self, tuning: GatheredTuning | None = None, strategy: str | None = None,
                 strategies: Table | None = None) -> None:
        if tuning is not None and not isinstance(tuning, GatheredTuning):
            raise TypeError(f"gathered executor: tuning must be a GatheredTuning (its numbers are checked there), "
                            f"got {type(tuning).__name__}")
        self.tuning, self.strategy, self.strategies = tuning, strategy, strategies or STRATEGIES
        if strategy is not None:
            get_strategy(strategy, self.strategies)  # a typo fails here, not at the first call

    def tuning_of(self, x: Tensor) -> GatheredTuning:
        return self.tuning or tuning_for(x.device)

    def supports(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> str | None:
        reasons = self.capabilities.reasons(inputs.x, plan.granularity)
        if reasons:
            return reasons[0]
        if weights.q_weight.dtype != inputs.x.dtype:
            return (f"weights are {weights.q_weight.dtype} but the input is {inputs.x.dtype}; cast the model "
                    "or the input so they match")
        return None

    def static(self, plan: HeadPlan, tuning: GatheredTuning) -> str | None:
        """Why this call is not sized (it runs a strategy that reads nothing back), or None when it is sized:
        under ``torch.compile``, with ``tuning.static_sequence`` (sequence plans) or ``tuning.static_token`` (token
        plans), or with such a strategy forced."""
        gran = plan.granularity
        if not any(not s.needs_sizes for s in self.strategies.get(gran, ())):
            return None
        if self.strategy is not None:
            forced = get_strategy(self.strategy, self.strategies)
            return None if forced.needs_sizes else f"strategy {forced.name!r} was asked for"
        if torch.compiler.is_compiling():
            return "under torch.compile"
        if gran == "sequence" and tuning.static_sequence:
            return f"tuning.static_sequence on {tuning.device}"
        if gran == "token" and tuning.static_token:
            return f"tuning.static_token on {tuning.device}"
        return None

    def sizes(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> GatherSizes:
        """The packed sizes of this call (one host synchronisation, none where :meth:`static` gives a reason); pass
        them to :meth:`run` to reuse them."""
        tuning = self.tuning_of(inputs.x)
        if self.static(plan, tuning) is not None:
            return static_sizes(plan)
        return gather_sizes(weights, inputs, plan, tuning)

    def prepare(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
                sizes: GatherSizes | None = None) -> Prepared:
        """Size the call (unless ``sizes`` are given) and choose its strategy; call the result to run it."""
        tuning = self.tuning_of(inputs.x)
        if sizes is None:
            sizes = self.sizes(weights, inputs, plan)
        call = GatheredCall(weights, inputs, plan, sizes, tuning)
        strategy = choose(call, self.strategy, self.strategies)
        if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):  # dynamo cannot trace loggers
            tried = "; ".join(f"{name}: {', '.join(why)}" for name, why in rejections(call, self.strategies) if why)
            logger.debug("%s runs %s (not: %s)", self.name, strategy.name, tried or "-")
        return Prepared(call, strategy, self.name)

    def explain(self, weights: AttentionWeights, inputs: AttentionInputs,
                plan: HeadPlan) -> list[tuple[str, list[str]]]:
        """Every strategy of the plan's granularity, in table order, with its reasons against this call; the
        capturable strategy's line says why it ran and what its ``k_cap`` costs, and the capturable strategies'
        lines say when the plan selects more heads than its ``k_cap`` (they refuse such a call)."""
        tuning = self.tuning_of(inputs.x)
        call = GatheredCall(weights, inputs, plan, self.sizes(weights, inputs, plan), tuning)
        found = rejections(call, self.strategies)
        why = self.static(plan, tuning)
        if why is not None:
            first = next((name for name, reasons in found if not reasons), None)  # the strategy that runs
            found = [(name, [static_note(plan, why, tuning)] if name == first else reasons) for name, reasons in found]
        over = (routed_over_cap if plan.granularity == "token" else over_cap)(plan)  # one host read, explain only
        if over is None:
            return found
        capturable = {s.name for s in self.strategies.get(plan.granularity, ()) if not s.needs_sizes}
        return [(name, [*reasons, over] if name in capturable else reasons) for name, reasons in found]

    def estimate(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Estimate:
        """Cost relative to dense attention: the share of the dense (query row, head) work the plan keeps, or
        just above dense where the tuning says dense attention is faster (a high share, or a call so small that
        what it skips does not pay for packing)."""
        tuning, gran, size = self.tuning_of(inputs.x), plan.granularity, inputs.x.numel()
        if tuning.prefers_dense(0.0, gran, size):  # decided without the host read
            return Estimate(DENSE_IS_FASTER, note=f"B*T*D = {size:,}: {_too_little_skipped(tuning, gran)}")
        prepared = self.prepare(weights, inputs, plan)  # under compile: static sizes, no read
        share = prepared.call.sizes.work_fraction
        if tuning.prefers_dense(share, gran, size):
            dense_share = tuning.dense_work_token if gran == "token" else tuning.dense_work_sequence
            why = (f"at least tuning.dense_work_{gran} = {dense_share}" if share >= dense_share else
                   f"skips {(1.0 - share) * size:,.0f}: {_too_little_skipped(tuning, gran)}")
            return Estimate(DENSE_IS_FASTER, prepared, prepared.strategy,
                            note=f"keeps {share:.2f} of the dense work, {why}")
        note = f"keeps {share:.2f} of the dense work"
        if not prepared.call.sizes.read and gran == "sequence":
            note += f" (k_cap = {plan.head_cap} of {plan.num_heads} heads per example, padded)"
        return Estimate(share, prepared, prepared.strategy, note=note)

    def run(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
            sizes: GatherSizes | None = None) -> Tensor:
        """``(B, T, D)``; ``sizes`` from :meth:`sizes` when the caller already read them back."""
        return self.prepare(weights, inputs, plan, sizes)(weights, inputs, plan)

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        return self.run(weights, inputs, plan)


def static_note(plan: HeadPlan, why: str, tuning: GatheredTuning) -> str:
    """What ``explain`` says of the capturable strategy: why it runs, what its padding costs, and whether its
    timings on this device are measured."""
    cap, H = plan.head_cap, plan.num_heads
    if plan.granularity == "token":
        shared = plan.shared_heads
        routed = max(min(cap, H) - shared, 0)
        cost = (f"the {shared} shared heads (HeadPlan.shared_heads) as one dense block, the other {H - shared} as "
                f"at most {routed} routed (token, head) pairs per token (HeadPlan.k_cap = {cap}); token.static "
                "computes every head's query and output projections and attention (dense cost); token.triton "
                "projects only the pairs' and, without gradients or dropout, attends only the pairs' rows (with "
                "them, every routed head's query slots)")
    elif plan.k_cap is not None and cap < H:
        cost = f"every example computes k_cap = {cap} of {H} heads (its selected heads padded with gate-0 heads)"
    else:
        cost = (f"the plan declares no k_cap below H = {H}, so every example computes all {H} heads: dense cost (a "
                "budget policy that declares a bound, e.g. fixed, or budgetformer with cap_at_s_max=True, sets one)")
    note = f"runs, reading nothing back ({why}): {cost}"
    if not tuning.measured:
        note += (f"; not timed on {tuning.device} yet (tuning.measured = False): auto's bounds for this device are "
                 "to be replaced from a record of this path")
    return note


def _too_little_skipped(tuning: GatheredTuning, granularity: str) -> str:
    """Why a call's skipped work is too small on this tuning's device (``explain`` prints it)."""
    bound = tuning.min_skipped_work_token if granularity == "token" else tuning.min_skipped_work_sequence
    origin = "measured" if tuning.measured else "partly or not measured: condcomp.executors.gathered.tuning says how"
    return (f"below tuning.min_skipped_work_{granularity} = {bound:,} of the {tuning.device} tuning ({origin}), "
            "where dense attention is faster")
