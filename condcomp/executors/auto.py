"""Executor lookup and ``executor="auto"``: the cheapest registered executor that can run the call.

``auto`` asks every registered executor whether it can run the call (its declared ``capabilities``, then
``supports``) and, of those that can, for an ``estimate`` of its cost relative to dense attention: ``masked`` is
dense attention (1.0), ``reference`` a loop over heads, ``gathered`` the share of the dense work the plan keeps (or
just above 1.0 where its tuning says dense is faster: a high share, or a call too small to pay for packing). The
cheapest runs, ties in ``AUTO_PREFERENCE`` order; executors without an estimate run only when no estimated one can.
The gathered executor's estimate reads its sizes once, and the executor ``auto`` returns reuses them: ``auto`` costs
no extra host synchronisation. :func:`explain` says what was chosen and why the others were not.

A call on a decoder request's compact KV cache (``AttentionInputs.kv_cache``: only the plan's key/value groups are
cached) can run only on an executor that declares ``reads_kv_cache`` (``kv_cache``). ``auto`` picks it; a named
executor that cannot read it is replaced by ``kv_cache`` for such calls, with one warning naming the fix, and
:func:`explain` says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from condcomp.notices import Notices
from condcomp.protocols import Estimate
from condcomp.registry import EXECUTORS
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

logger = logging.getLogger("condcomp")

# Order of executors with equal estimated cost (and of those without an estimate); others follow by name.
AUTO_PREFERENCE = ("gathered", "masked", "reference")

_INSTANCES: dict[str, tuple[Any, Any]] = {}  # name -> (registered factory, its shared instance)


def executor_key_error(value: object) -> str:
    """The message for an executor given as something other than its registered name."""
    return (f"executor must be a string key, got {value!r}; to use an executor object of your own (e.g. "
            "GatheredExecutor with another tuning), register a class that builds it with "
            "@condcomp.register_executor('name') and pass executor='name' (docs/extending.md)")


def get_executor(name: str) -> Any:
    """The shared instance of a registered executor (executors are stateless)."""
    if not isinstance(name, str):
        raise TypeError(executor_key_error(name))
    key = name.lower()
    factory = EXECUTORS.get(key)
    cached = _INSTANCES.get(key)
    if cached is None or cached[0] is not factory:  # a name registered again (override=True) takes effect at once
        cached = _INSTANCES[key] = (factory, _named(factory(), key))
    return cached[1]


def _named(executor: Any, key: str) -> Any:
    """``executor`` reporting ``key`` as its name (what ``head_usage`` and ``explain`` say ran) when its class
    inherits the name of the executor it derives from (a ``GatheredExecutor`` subclass with another tuning,
    registered under its own key); a name the class sets itself is kept."""
    inherited = "name" not in vars(type(executor)) and "name" not in getattr(executor, "__dict__", {})
    if inherited and getattr(executor, "name", key) != key:
        try:
            executor.name = key
        except (AttributeError, TypeError):  # a read-only name (a property, slots): left as it is
            pass
    return executor


CACHE_EXECUTOR = "kv_cache"  # the executor that runs calls on a compact KV cache when the named one cannot


def cache_rejection(executor: Any, inputs: AttentionInputs) -> str | None:
    """Why ``executor`` cannot run a call on a compact KV cache, or None (no such cache, or it reads one)."""
    if inputs.kv_cache is None or getattr(getattr(executor, "capabilities", None), "reads_kv_cache", False):
        return None
    return ("the call reads a request's compact KV cache (only the key/value groups its plan keeps are cached), "
            "which only an executor with capabilities.reads_kv_cache can read")


def rejection(executor: Any, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> str | None:
    """Why ``executor`` cannot run the call (a compact KV cache it cannot read, its declared capabilities), or
    None."""
    cached = cache_rejection(executor, inputs)
    if cached is not None:
        return cached
    caps = getattr(executor, "capabilities", None)
    reasons = caps.reasons(inputs.x, plan.granularity) if caps is not None else []
    return "; ".join(reasons) if reasons else executor.supports(weights, inputs, plan)


@dataclass
class Choice:
    """What ``auto`` (or a named executor) decided for one call; ``str()`` is the explanation."""

    executor: str
    instance: Any  # the executor object
    run: Any  # what to call: (weights, inputs, plan) -> (B, T, D)
    verdicts: list[tuple[str, str]] = field(default_factory=list)  # (executor, why it ran or did not)
    strategies: list[tuple[str, list[str]]] = field(default_factory=list)  # the chosen executor's strategies, if any

    @property
    def strategy(self) -> str | None:
        return getattr(self.run, "strategy", None)

    def __str__(self) -> str:
        lines = [f"runs {self.executor}" + (f" (strategy {self.strategy})" if self.strategy else "")]
        lines += [f"  {name}: {why}" for name, why in self.verdicts]
        lines += [f"  strategy {name}: {'; '.join(why) if why else 'can run'}" for name, why in self.strategies]
        return "\n".join(lines)


def _pool() -> list[Any]:
    names = [n for n in AUTO_PREFERENCE if n in EXECUTORS.names()]
    return [get_executor(n) for n in names + [n for n in EXECUTORS.names() if n not in names]]


def choose(name: str, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
           pool: list[Any] | None = None, notices: Notices | None = None) -> Choice:
    """The executor to run this call and why; raises with every rejection and its reason when none can.
    ``pool``: the executors ``auto`` chooses among (default: every registered one); ``notices``: the warnings
    already given (a named executor replaced on a cached call is announced once per ``notices``)."""
    if name != "auto":
        executor = get_executor(name)
        if cache_rejection(executor, inputs) is not None:
            return _cache_replacement(executor.name, weights, inputs, plan, notices)
        reason = rejection(executor, weights, inputs, plan)
        if reason is not None:
            raise RuntimeError(f"executor {name!r} cannot run this call: {reason}")
        prepare = getattr(executor, "prepare", None)  # size and strategy now (the gathered executor)
        return Choice(executor.name, executor, prepare(weights, inputs, plan) if callable(prepare) else executor)
    verdicts: list[tuple[str, str]] = []
    ranked: list[tuple[float, int, Any, Any]] = []
    unranked = []
    for order, executor in enumerate(pool if pool is not None else _pool()):
        reason = rejection(executor, weights, inputs, plan)
        estimate = getattr(executor, "estimate", None)
        if reason is not None:
            verdicts.append((executor.name, f"cannot run: {reason}"))
        elif callable(estimate):
            e: Estimate = estimate(weights, inputs, plan)
            verdicts.append((executor.name, f"cost {e.cost:.2f}" + (f" ({e.note})" if e.note else "")))
            ranked.append((e.cost, order, executor, e.run or executor))
        else:
            verdicts.append((executor.name, "no cost estimate"))
            unranked.append(executor)
    if ranked:
        best = ranked[0]  # the cheapest, ties by order (a loop: torch.compile cannot trace min(..., key=))
        for r in ranked[1:]:
            if (r[0], r[1]) < (best[0], best[1]):
                best = r
        _, _, executor, run = best
    elif unranked:
        executor = run = unranked[0]
    else:
        raise RuntimeError("no executor can run this call:\n  " + "\n  ".join(f"{n}: {v}" for n, v in verdicts))
    choice = Choice(executor.name, executor, run, verdicts)
    if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):  # dynamo cannot trace loggers
        logger.debug("auto: %s", str(choice).replace("\n", ";"))
    return choice


def _cache_replacement(name: str, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
                       notices: Notices | None) -> Choice:
    """``kv_cache`` for a cached call the named executor cannot read, announced once per executor and ``notices``."""
    why = (f"{name!r} cannot read a decoder request's compact KV cache (only the key/value groups the plan keeps "
           f"are cached): {CACHE_EXECUTOR!r} runs the cached calls instead. To compare {name!r} with it on the same "
           "plans, run without a cache (use_cache=False, inside condcomp.plan_from_prompt for generate)")
    (notices or Notices()).warn_once(name, why, stacklevel=4)
    choice = choose(CACHE_EXECUTOR, weights, inputs, plan)
    choice.verdicts = [(name, f"cannot run: {why}"), *choice.verdicts]
    return choice


def resolve_executor(name: str, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
                     pool: list[Any] | None = None, notices: Notices | None = None) -> Any:
    """The executor to run this call (called as ``executor(weights, inputs, plan)``; its ``name`` and, for the
    gathered executor, ``strategy`` say what runs); raises with every rejection and its reason when none can.

    >>> import torch, condcomp
    >>> from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout
    >>> L = HeadLayout(d_model=8, num_heads=2, num_kv_heads=2, head_dim=4, scale=0.5)
    >>> w = AttentionWeights(L, torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    >>> full = condcomp.full_plan(1, 2, torch.device("cpu"))
    >>> resolve_executor("auto", w, AttentionInputs(x=torch.randn(1, 3, 8)), full).name
    'masked'
    """
    quiet = torch.compiler.is_compiling() or not logger.isEnabledFor(logging.DEBUG)  # a Logger is not traceable
    if name == "auto" and pool is None and inputs.kv_cache is not None and quiet:
        # auto on a compact cache: only executors that read one can run; when kv_cache is the only registered one,
        # asking it directly gives auto's run without estimating (and explaining) every executor (each decode step
        # of each layer). A call it refuses goes the long way, for auto's own error message.
        executor = _sole_cache_reader()
        if executor is not None and rejection(executor, weights, inputs, plan) is None:
            return executor.prepare(weights, inputs, plan)
    return choose(name, weights, inputs, plan, pool, notices).run


# (the registry's entries, what _sole_cache_reader answered for them): derived again when the registry changes
_SOLE_READER: list[Any] = [None]


def _sole_cache_reader() -> Any:
    """condcomp's ``kv_cache`` executor when it is the only registered executor that reads a compact KV cache, else
    None (another such executor, or ``kv_cache`` registered again, would compete on its own estimate)."""
    entries = EXECUTORS.entries()
    known = _SOLE_READER[0]
    if known is not None and known[0] == entries:
        return known[1]
    from condcomp.executors.cached import CachedExecutor  # its estimate on a cached call: cost 0, run = prepare

    readers = [n for n, _ in entries
               if getattr(getattr(get_executor(n), "capabilities", None), "reads_kv_cache", False)]
    executor = get_executor(CACHE_EXECUTOR) if readers == [CACHE_EXECUTOR] else None
    answer = executor if type(executor) is CachedExecutor else None
    _SOLE_READER[0] = (entries, answer)
    return answer


def explain(weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan, executor: str = "auto",
            pool: list[Any] | None = None) -> Choice:
    """Which executor (and strategy) runs this call and why every other did not; print it to read it.

    >>> import torch, condcomp
    >>> from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout
    >>> L = HeadLayout(d_model=8, num_heads=2, num_kv_heads=2, head_dim=4, scale=0.5)
    >>> w = AttentionWeights(L, torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    >>> plan = condcomp.plan_from_active(torch.tensor([[True, False]]))
    >>> print(condcomp.explain(w, AttentionInputs(x=torch.randn(1, 3, 8)), plan).executor)
    masked
    """
    choice = choose(executor, weights, inputs, plan, pool)
    strategies = getattr(choice.instance, "explain", None)
    if callable(strategies):
        choice.strategies = strategies(weights, inputs, plan)
    return choice
