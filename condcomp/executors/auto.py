"""Executor lookup and ``executor="auto"``: the fastest registered executor that can run the call.

``auto`` walks ``AUTO_PREFERENCE`` and keeps the executors whose ``supports()`` accepts the call (the error lists
every rejection and its reason when none does). Between ``gathered`` and ``masked`` it decides from the plan:
the gathered path reads back its packed sizes once per call anyway, and from them ``auto`` knows the share of the
dense (query row, head) work the plan keeps. At or above ``DENSE_WORK_FRACTION`` of it (for example every head
active, as in training under soft gates; the bound is set separately for calls where autograd records, whose
backward changes the balance) there is nothing worth skipping and ``masked`` (= dense attention, one
fused SDPA call) is faster; so it is when the call is so small that the work skipped, ``(1 - share) * B*T*D``,
is below ``MIN_SKIPPED_WORK``. Otherwise ``gathered`` runs with the sizes already read, so ``auto`` costs no
extra host synchronisation. The thresholds come from ``condcomp bench attention`` and timings at small sizes
(docs/performance.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from condcomp.registry import EXECUTORS
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

# Preference of "auto", fastest first where it can run (docs/performance.md has the measurements).
AUTO_PREFERENCE = ("gathered", "masked", "reference")

# Kept share of the dense work at or above which "auto" runs "masked" instead of "gathered", per granularity,
# (without autograd, with autograd): crossovers measured by `condcomp bench attention` (docs/performance.md).
DENSE_WORK_FRACTION = {"sequence": (0.8, 0.8), "token": (0.65, 0.65)}

# Skipped work, (1 - kept share) * B * T * D, below which "auto" runs "masked" whatever the share: in small calls
# gathered's fixed cost (its host read, the kernels that pack and unpack) outweighs what it skips. Per
# granularity, crossovers measured on CPU at toy-to-small sizes (docs/performance.md); the token path packs more.
MIN_SKIPPED_WORK = {"sequence": 60_000, "token": 300_000}

_INSTANCES: dict[str, tuple[Any, Any]] = {}  # name -> (registered factory, its shared instance)


def get_executor(name: str) -> Any:
    """The shared instance of a registered executor (executors are stateless)."""
    key = name.lower()
    factory = EXECUTORS.get(key)
    cached = _INSTANCES.get(key)
    if cached is None or cached[0] is not factory:  # a name registered again (override=True) takes effect at once
        cached = _INSTANCES[key] = (factory, factory())
    return cached[1]


class _Sized:
    """The gathered executor bound to the sizes ``auto`` already read back (no second host sync)."""

    def __init__(self, executor: Any, sizes: Any) -> None:
        self.executor, self.sizes, self.name = executor, sizes, executor.name

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor:
        return self.executor.run(weights, inputs, plan, self.sizes)


def prefer_dense(work_fraction: float, granularity: str, training: bool = False, size: int | None = None) -> bool:
    """Whether a plan keeping ``work_fraction`` of the dense work should run densely (``masked``).

    ``training``: autograd is recording, so a backward pass will follow (its crossover is measured separately).
    ``size``: ``B * T * D`` of the call; when the work skipped is below ``MIN_SKIPPED_WORK``, dense it is.
    """
    inference, backward = DENSE_WORK_FRACTION.get(granularity, (1.0, 1.0))
    if size is not None and (1.0 - work_fraction) * size < MIN_SKIPPED_WORK.get(granularity, 0):
        return True
    return work_fraction >= (backward if training else inference)


def resolve_executor(name: str, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Any:
    """The executor to run this call; raises with every rejection and its reason when none can.

    >>> import torch, condcomp
    >>> from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout
    >>> L = HeadLayout(d_model=8, num_heads=2, num_kv_heads=2, head_dim=4, scale=0.5)
    >>> w = AttentionWeights(L, torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    >>> full = condcomp.full_plan(1, 2, torch.device("cpu"))
    >>> resolve_executor("auto", w, AttentionInputs(x=torch.randn(1, 3, 8)), full).name
    'masked'
    """
    if name != "auto":
        executor = get_executor(name)
        reason = executor.supports(weights, inputs, plan)
        if reason is not None:
            raise RuntimeError(f"executor {name!r} cannot run this call: {reason}")
        return executor
    rejections = []
    candidates = [n for n in AUTO_PREFERENCE if n in EXECUTORS.names()]
    candidates += [n for n in EXECUTORS.names() if n not in candidates]
    usable = []
    for candidate in candidates:
        executor = get_executor(candidate)
        reason = executor.supports(weights, inputs, plan)
        if reason is None:
            usable.append(executor)
        else:
            rejections.append(f"{candidate}: {reason}")
    if not usable:
        raise RuntimeError("no executor can run this call:\n  " + "\n  ".join(rejections))
    first = usable[0]
    if first.name == "gathered" and hasattr(first, "sizes"):
        dense = next((e for e in usable if e.name == "masked"), None)
        if dense is not None and prefer_dense(0.0, plan.granularity, size=inputs.x.numel()):
            return dense  # too small even if every head were skipped: no need for the sizes read
        sizes = first.sizes(weights, inputs, plan)  # the one host read the gathered path needs anyway
        training = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (inputs.x, weights.q_weight, plan.gates))
        if dense is not None and prefer_dense(sizes.work_fraction, plan.granularity, training, inputs.x.numel()):
            return dense
        return _Sized(first, sizes)
    return first
