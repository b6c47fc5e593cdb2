"""The gathered executor's dispatch table: every route, in the order they are tried, per plan granularity.

To follow a plan: the executor sizes the call (sizing.py, the one host read), then walks the table of the plan's
granularity and runs the first route whose ``supports`` gives no reason against it. The reasons of every route
tried before it are what ``condcomp.explain`` and the ``condcomp`` logger's debug line report.
"""

from __future__ import annotations

from condcomp.executors.gathered import sequence, token
from condcomp.executors.gathered.call import GatheredCall, Route

ROUTES: dict[str, tuple[Route, ...]] = {
    "sequence": (sequence.SharedSet(), sequence.Grouped(), sequence.OneBucket(), sequence.Buckets()),
    "token": (token.Dense(), token.BySet(), token.PerHead()),
}


Table = dict[str, tuple[Route, ...]]


def route_names(table: Table | None = None) -> list[str]:
    """Every route's name, in table order."""
    return [r.name for routes in (table or ROUTES).values() for r in routes]


def get_route(name: str, table: Table | None = None) -> Route:
    for routes in (table or ROUTES).values():
        for r in routes:
            if r.name == name:
                return r
    raise KeyError(f"unknown gathered route {name!r}; routes: {', '.join(route_names(table))}")


def choose(call: GatheredCall, only: str | None = None, table: Table | None = None) -> Route:
    """The first route of the plan's granularity that can run ``call`` (``only``: that route or an error)."""
    if only is not None:
        route = get_route(only, table)
        if route.granularity != call.plan.granularity:
            raise RuntimeError(f"route {only!r} runs {route.granularity} plans, not {call.plan.granularity} plans")
        reasons = route.supports(call)
        if reasons:
            raise RuntimeError(f"route {only!r} cannot run this call: {'; '.join(reasons)}")
        return route
    for route in (table or ROUTES)[call.plan.granularity]:
        if not route.supports(call):
            return route
    raise AssertionError("the last route of each granularity runs every call")  # pragma: no cover


def rejections(call: GatheredCall, table: Table | None = None) -> list[tuple[str, list[str]]]:
    """Every route of the plan's granularity with its reasons against ``call`` (empty: it could run)."""
    return [(route.name, route.supports(call)) for route in (table or ROUTES)[call.plan.granularity]]
