"""The gathered executor's dispatch table: every strategy, in the order they are tried, per plan granularity.

To follow a plan: the executor sizes the call (sizing.py, the one host read), then walks the table of the plan's
granularity and runs the first strategy whose ``supports`` gives no reason against it. The reasons of every strategy
tried before it are what ``condcomp.explain`` and the ``condcomp`` logger's debug line report.
"""

from __future__ import annotations

from condcomp.executors.gathered import sequence, sequence_static, sequence_triton, token, token_static
from condcomp.executors.gathered.call import GatheredCall, Strategy

# sequence.static and token.static come last: a sized call (sizes read back) always finds one of the sized strategies
# before them, and a call sized without a read (under torch.compile, or tuning.static_sequence / static_token) only
# they and the Triton strategies before them can run.
STRATEGIES: dict[str, tuple[Strategy, ...]] = {
    "sequence": (sequence.SharedSet(), sequence.Grouped(), sequence.OneBucket(), sequence.Buckets(),
                 sequence_triton.PairKernels(), sequence_static.Static()),
    "token": (token.Dense(), token.BySet(), token.PerHead(), token_static.Pairs(), token_static.Static()),
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
        reasons = reasons_against(strategy, call)
        if reasons:
            raise RuntimeError(f"strategy {only!r} cannot run this call: {'; '.join(reasons)}")
        return strategy
    for strategy in (table or STRATEGIES)[call.plan.granularity]:
        if not reasons_against(strategy, call):
            return strategy
    raise RuntimeError(f"no gathered strategy can run this call: {rejections(call, table)}")


def rejections(call: GatheredCall, table: Table | None = None) -> list[tuple[str, list[str]]]:
    """Every strategy of the plan's granularity with its reasons against ``call`` (empty: it could run)."""
    return [(s.name, reasons_against(s, call)) for s in (table or STRATEGIES)[call.plan.granularity]]


def reasons_against(strategy: Strategy, call: GatheredCall) -> list[str]:
    """Why ``strategy`` cannot run ``call``: its own reasons, or that it needs sizes this call did not read."""
    if strategy.needs_sizes and not call.sizes.read:
        gran = call.plan.granularity
        runs = next((s.name for s in STRATEGIES[gran] if not s.needs_sizes and not s.supports(call)), f"{gran}.static")
        return ["needs the call's sizes read back from the device, and this call reads nothing (under "
                f"torch.compile, or tuning.static_{gran} on this device): {runs} runs it"]
    return strategy.supports(call)
