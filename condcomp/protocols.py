"""The three roles as structural protocols: third-party components need not inherit from anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from condcomp.types import AttentionInputs, AttentionWeights, Budget, Granularity, HeadPlan


@runtime_checkable
class BudgetPolicy(Protocol):
    """Decides how many heads each row may use: ``(x (B, T, D), mask (B, T) | None) -> Budget``.

    A policy that also reads a per-example conditioning vector (a diffusion model's timestep embedding) sets the
    class attribute ``reads_condition = True`` and accepts ``condition=`` (``(B, Dc)``) as a keyword; the layer
    passes what its caller gave (``HeadAttention(..., condition=c)``) and only to such policies.
    """

    def __call__(self, x: Tensor, mask: Tensor | None) -> Budget: ...


@runtime_checkable
class Router(Protocol):
    """Decides which heads, with what gates: ``(x, mask, budget, attn) -> HeadPlan``.

    ``attn`` is the layer's :class:`~condcomp.AttentionWeights` (``attn.project_queries(x)`` gives queries).
    A router declares ``granularity = "sequence"`` or ``"token"``.
    """

    granularity: Granularity

    def __call__(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan: ...


@runtime_checkable
class Executor(Protocol):
    """Computes attention for a plan; a pure function of (weights, inputs, plan).

    ``supports`` returns None when the executor can run the call, else the reason it cannot. Two optional members
    let an executor compete in ``executor="auto"``: ``capabilities`` (a :class:`Capabilities`: what it can run at
    all, checked before ``supports``) and ``estimate(weights, inputs, plan) -> Estimate`` (its expected cost
    relative to dense attention; the cheapest usable executor runs, executors without one rank last).
    """

    name: str

    def supports(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> str | None: ...

    def __call__(self, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan) -> Tensor: ...


@dataclass(frozen=True)
class Capabilities:
    """What an executor can run at all; ``None`` = any. ``auto`` checks these before calling ``supports``.

    ``skips_work``: its cost falls with the share of heads the plan keeps (the gathered executor), rather than
    being the dense cost whatever the plan (masked, reference). ``reads_kv_cache``: it can run a call on a
    decoder request's compact KV cache (``AttentionInputs.kv_cache``, the ``kv_cache`` executor); no other can.

    >>> caps = Capabilities(granularities=("sequence",), dtypes=(torch.float32,))
    >>> caps.reasons(torch.zeros(1, dtype=torch.float64), "token")
    ["granularity 'token' is not one of ('sequence',)", 'dtype torch.float64 is not one of (torch.float32,)']
    """

    granularities: tuple[str, ...] = ("sequence", "token")
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    skips_work: bool = False
    reads_kv_cache: bool = False

    def reasons(self, x: Tensor, granularity: str) -> list[str]:
        """Why a call with query input ``x`` and a plan of ``granularity`` is outside these capabilities."""
        out = []
        if granularity not in self.granularities:
            out.append(f"granularity {granularity!r} is not one of {self.granularities}")
        if self.devices is not None and x.device.type not in self.devices:
            out.append(f"device {x.device.type!r} is not one of {self.devices}")
        if self.dtypes is not None and x.dtype not in self.dtypes:
            out.append(f"dtype {x.dtype} is not one of {self.dtypes}")
        return out


@dataclass(frozen=True)
class Estimate:
    """An executor's expected cost of one call, relative to dense attention over every head (``masked`` = 1.0).

    ``run``: the executor bound to whatever it read to estimate (the gathered executor's sizes and strategy), so
    running the call does not read again; None = call the executor. ``strategy`` names the way it would run the
    call, ``note`` says why the cost is what it is (both shown by ``condcomp.explain``).
    """

    cost: float
    run: Callable[[AttentionWeights, AttentionInputs, HeadPlan], Tensor] | None = None
    strategy: str | None = None
    note: str = ""
