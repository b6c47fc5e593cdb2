"""The gathered-sparse executor: only the selected (example, head) or (token, head) pairs are computed.

Read it in this order: tuning.py (every threshold, per device), sizing.py (the one device -> host read), call.py
(the sized call and what a route is), routes.py (the dispatch table: which route runs which call), then the routes:
sequence.py (with sequence_grouped.py) and token.py, built from the shared blocks in blocks.py.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from condcomp.executors.gathered.call import GatheredCall, Route
from condcomp.executors.gathered.routes import ROUTES, Table, choose, get_route, rejections, route_names
from condcomp.executors.gathered.sizing import GatherSizes, gather_sizes, head_set_keys, kv_active
from condcomp.executors.gathered.tuning import CPU, CUDA, GatheredTuning, tuning_for
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

__all__ = ["CPU", "CUDA", "ROUTES", "GatherSizes", "GatheredCall", "GatheredExecutor", "GatheredTuning",
           "Prepared", "Route", "gather_sizes", "get_route", "head_set_keys", "kv_active", "route_names",
           "tuning_for"]

logger = logging.getLogger("condcomp")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The cost reported where the tuning says dense attention is faster: just above masked's 1.0, so that auto runs
# masked when it can and gathered (already sized, no second read) when masked cannot run the call.
DENSE_IS_FASTER = 1.01


class Prepared:
    """A call sized and routed by :meth:`GatheredExecutor.prepare`: calling it runs the chosen route.
    ``route`` is that route's name (what ``HeadUsage.route`` reports)."""

    def __init__(self, call: GatheredCall, chosen: Route, name: str = "gathered") -> None:
        self.call, self.chosen, self.route, self.name = call, chosen, chosen.name, name

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        call = self.call
        if weights is not call.weights or inputs is not call.inputs or plan is not call.plan:  # same sizes
            call = GatheredCall(weights, inputs, plan, call.sizes, call.tuning)
        return self.chosen.run(call)


@register_executor("gathered")
class GatheredExecutor:
    """Computes only the selected heads: the work scales with the number of (row, head) pairs chosen.

    Each call is sized once (one host synchronisation) and run by the first route of the dispatch table
    (:data:`condcomp.executors.gathered.ROUTES`) that can run it. Same semantics as the ``reference`` executor:
    outputs and gradients agree with it. ``tuning``: thresholds (default: those of the call's device);
    ``route``: run only this route (an error names why it cannot run a call), for tests and A/B timing;
    ``routes``: the dispatch table (default :data:`ROUTES`; docs/extending.md adds a route).

    >>> from condcomp.executors import get_executor
    >>> get_executor("gathered").name
    'gathered'
    >>> GatheredExecutor(route="sequence.buckets").route
    'sequence.buckets'
    """

    name = "gathered"
    granularities = ("sequence", "token")
    capabilities = Capabilities(dtypes=_FLOAT_DTYPES, skips_work=True)

    def __init__(self, tuning: GatheredTuning | None = None, route: str | None = None,
                 routes: Table | None = None) -> None:
        self.tuning, self.route, self.routes = tuning, route, routes or ROUTES
        if route is not None:
            get_route(route, self.routes)  # a typo fails here, not at the first call

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

    def sizes(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> GatherSizes:
        """The packed sizes of this call (one host synchronisation); pass them to :meth:`run` to reuse them."""
        return gather_sizes(weights, inputs, plan, self.tuning_of(inputs.x))

    def prepare(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
                sizes: GatherSizes | None = None) -> Prepared:
        """Size the call (unless ``sizes`` are given) and choose its route; call the result to run it."""
        tuning = self.tuning_of(inputs.x)
        if sizes is None:
            sizes = gather_sizes(weights, inputs, plan, tuning)
        call = GatheredCall(weights, inputs, plan, sizes, tuning)
        route = choose(call, self.route, self.routes)
        if logger.isEnabledFor(logging.DEBUG):
            tried = "; ".join(f"{name}: {', '.join(why)}" for name, why in rejections(call, self.routes) if why)
            logger.debug("%s runs %s (not: %s)", self.name, route.name, tried or "-")
        return Prepared(call, route, self.name)

    def explain(self, weights: AttentionWeights, inputs: AttentionInputs,
                plan: HeadPlan) -> list[tuple[str, list[str]]]:
        """Every route of the plan's granularity, in table order, with its reasons against this call."""
        return rejections(GatheredCall(weights, inputs, plan, self.sizes(weights, inputs, plan),
                                       self.tuning_of(inputs.x)), self.routes)

    def estimate(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Estimate:
        """Cost relative to dense attention: the share of the dense (query row, head) work the plan keeps, or
        just above dense where the tuning says dense attention is faster (a high share, or a call so small that
        what it skips does not pay for packing)."""
        tuning, gran, size = self.tuning_of(inputs.x), plan.granularity, inputs.x.numel()
        if tuning.prefers_dense(0.0, gran, size):  # decided without the host read
            return Estimate(DENSE_IS_FASTER, note=f"B*T*D = {size:,} is too small to pay for packing "
                                                  f"(tuning.min_skipped_work_{gran})")
        prepared = self.prepare(weights, inputs, plan)
        share = prepared.call.sizes.work_fraction
        if tuning.prefers_dense(share, gran, size):
            return Estimate(DENSE_IS_FASTER, prepared, prepared.route,
                            note=f"keeps {share:.2f} of the dense work (tuning.dense_work_{gran}, "
                                 f"tuning.min_skipped_work_{gran})")
        return Estimate(share, prepared, prepared.route, note=f"keeps {share:.2f} of the dense work")

    def run(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
            sizes: GatherSizes | None = None) -> Tensor:
        """``(B, T, D)``; ``sizes`` from :meth:`sizes` when the caller already read them back."""
        return self.prepare(weights, inputs, plan, sizes)(weights, inputs, plan)

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        return self.run(weights, inputs, plan)
