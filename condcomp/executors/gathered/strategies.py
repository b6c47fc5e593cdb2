"""The gathered executor's dispatch table: every strategy, in the order they are tried, per plan granularity.

To follow a plan: the executor sizes the call (sizing.py, the one host read), then walks the table of the plan's
granularity and runs the first strategy whose ``supports`` gives no reason against it. The reasons of every strategy
tried before it are what ``condcomp.explain`` and the ``condcomp`` logger's debug line report.
"""

from __future__ import annotations

from condcomp.executors.gathered import sequence, sequence_triton, token
from condcomp.executors.gathered.call import GatheredCall, Strategy

STRATEGIES: dict[str, tuple[Strategy, ...]] = {
    "sequence": (sequence.SharedSet(), sequence_triton.PairKernels(), sequence.Grouped(), sequence.OneBucket(),
                 sequence.Buckets()),
    "token": (token.Dense(), token.BySet(), token.PerHead()),
}


Table = dict[str, tuple[Strategy, ...]]


def strategy_names(table: Table | None = None) -> list[str]:
    """Every strategy's name, in table order."""
    return [r.name for strategies in (table or STRATEGIES).values() for r in strategies]


def get_strategy(name: str, table: Table | None = None) -> Strategy:
    for strategies in (table or STRATEGIES).values():
        for r in strategies:
            if r.name == name:
                return r
    raise KeyError(f"unknown gathered strategy {name!r}; strategies: {', '.join(strategy_names(table))}")


def choose(call: GatheredCall, only: str | None = None, table: Table | None = None) -> Strategy:
    """The first strategy of the plan's granularity that can run ``call`` (``only``: that strategy or an error)."""
    if only is not None:
        strategy = get_strategy(only, table)
        if strategy.granularity != call.plan.granularity:
            raise RuntimeError(f"strategy {only!r} runs {strategy.granularity} plans, "
                               f"not {call.plan.granularity} plans")
        reasons = strategy.supports(call)
        if reasons:
            raise RuntimeError(f"strategy {only!r} cannot run this call: {'; '.join(reasons)}")
        return strategy
    for strategy in (table or STRATEGIES)[call.plan.granularity]:
        if not strategy.supports(call):
            return strategy
    raise AssertionError("the last strategy of each granularity runs every call")  # pragma: no cover


def rejections(call: GatheredCall, table: Table | None = None) -> list[tuple[str, list[str]]]:
    """Every strategy of the plan's granularity with its reasons against ``call`` (empty: it could run)."""
    return [(strategy.name, strategy.supports(call)) for strategy in (table or STRATEGIES)[call.plan.granularity]]
