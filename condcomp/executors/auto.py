"""Executor lookup and ``executor="auto"``: the fastest registered executor that can run the call."""

from __future__ import annotations

from typing import Any

from condcomp.registry import EXECUTORS
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

# Preference of "auto", fastest first where it can run (docs/performance.md has the measurements).
AUTO_PREFERENCE = ("gathered", "masked", "reference")

_INSTANCES: dict[str, Any] = {}


def get_executor(name: str) -> Any:
    """The shared instance of a registered executor (executors are stateless)."""
    key = name.lower()
    if key not in _INSTANCES:
        _INSTANCES[key] = EXECUTORS.get(key)()
    return _INSTANCES[key]


def resolve_executor(name: str, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Any:
    """The executor to run this call; raises with every rejection and its reason when none can."""
    if name != "auto":
        executor = get_executor(name)
        reason = executor.supports(weights, inputs, plan)
        if reason is not None:
            raise RuntimeError(f"executor {name!r} cannot run this call: {reason}")
        return executor
    rejections = []
    candidates = [n for n in AUTO_PREFERENCE if n in EXECUTORS.names()]
    candidates += [n for n in EXECUTORS.names() if n not in candidates]
    for candidate in candidates:
        executor = get_executor(candidate)
        reason = executor.supports(weights, inputs, plan)
        if reason is None:
            return executor
        rejections.append(f"{candidate}: {reason}")
    raise RuntimeError("no executor can run this call:\n  " + "\n  ".join(rejections))
