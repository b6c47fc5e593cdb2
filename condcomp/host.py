"""RoutingHost: what both ways of attaching routing to a model share.

Two modules attach a budget policy and a router to a model: the module swap (:class:`~condcomp.RoutedAttention`)
and transformers' AttentionInterface path (``condcomp.integrations.hf.interface``). Both are ``RoutingHost``s, so
the model-level functions (``aux_loss``, ``set_progress``, ``head_usage``) have one code path for both, and both
follow the same rules:

- **Routing stays float32.** Casting a wrapped model (``.to(torch.bfloat16)``, ``.half()``, ``.double()``, FSDP
  mixed precision) casts the attention weights and leaves the policy's and router's parameters in float32:
  decisions (budgets, softmax, top-k) need the range, and the components cast their inputs to float32.
- **Training progress is state.** ``set_progress`` writes it into the ``condcomp_progress`` buffer, so
  ``state_dict`` round trips, condcomp and Hugging Face checkpoints, ``deepcopy`` and DDP carry it; a buffer
  changed by loading is pushed to the components at the next forward (schedules resume where they were).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.flops import dense_flops, flop_fraction, plan_flops, routing_flops
from condcomp.kv.selection import decision_mask
from condcomp.notices import Notices
from condcomp.options import real
from condcomp.plans import budget_k, budget_k_bound, plan_from_active
from condcomp.types import AttentionWeights, Budget, HeadLayout, HeadPlan, HeadUsage
from condcomp.versions import tensor_version


@dataclass(frozen=True)
class LastForward:
    """What the last forward decided, detached; turned into numbers only when someone asks (no device sync)."""

    s: Tensor  # (B,) or (B, T)
    plan: HeadPlan
    mask: Tensor | None  # (B, T)
    T: int
    S: int
    executor: str | None = None  # the executor (and gathered strategy) that ran, when an executor ran
    strategy: str | None = None
    streamed: Tensor | None = None  # (B, H) bool: heads that attended a streaming window, not the full context
    window_keys: int = 0  # the most keys a streamed head reads (the window's sinks + recent tokens)
    held_full: Tensor | None = None  # (B, H) bool: heads the plan skips that the KV policy computes in full


PROGRESS_BUFFER = "condcomp_progress"  # the buffer's name in state_dicts (one without it loads: _load_from_state_dict)


def _progress_bits(progress: float) -> Tensor:
    # The float64 bit pattern in an int64 buffer: exact, and no dtype cast of the model (.half(), .to(bf16))
    # touches integer buffers.
    return torch.tensor(progress, dtype=torch.float64).view(torch.int64)


def _progress_value(bits: Tensor) -> float:
    return float(bits.detach().cpu().view(torch.float64))


def check_progress(progress: float) -> float:
    """``progress`` as a float, or a ValueError when it is not a number in [0, 1]."""
    p = float(progress)
    if not (math.isfinite(p) and 0.0 <= p <= 1.0):
        raise ValueError(f"progress must be in [0, 1], got {progress}")
    return p


class RoutingHost(nn.Module):
    """Base of the modules that hold a policy and a router (``condcomp_policy``, ``condcomp_router``) for an
    attention module read through ``adapter`` (an :class:`~condcomp.AttentionAdapter`)."""

    adapter: Any
    condcomp_progress: Tensor

    @property
    def layout(self) -> HeadLayout:
        """The attention module's :class:`~condcomp.HeadLayout`."""
        return self.adapter.layout  # type: ignore[no-any-return]

    def attach_routing(self, policy: Any, router: Any) -> None:
        """Register the components and the progress buffer (call once, from ``__init__``)."""
        self.condcomp_policy = policy
        self.condcomp_router = router
        self.register_buffer(PROGRESS_BUFFER, _progress_bits(0.0))
        self._progress_pushed = 0.0  # what the components were last stepped to
        self._progress_seen: tuple[Tensor, int | None] = (self.condcomp_progress,
                                                          tensor_version(self.condcomp_progress))
        self.last: LastForward | None = None
        self._last_aux: dict[str, Tensor] = {}
        # the warnings already given (apply_ shares one among a model's layers), held as data: a decode step reads it
        self.__dict__["condcomp_notices"] = Notices()
        self.condcomp_disabled = False  # set by condcomp.disabled(model): run the original module instead
        self.prompt_len: int | None = None  # set by condcomp.plan_from_prompt: sequence plans see the prompt only
        self.budget_fraction: float | None = None  # set by condcomp.budget: every row keeps this fraction
        self.budget_cap: int | None = None  # ... and its k_cap (budget_cap_of), a host int: compile specialises it
        self._keep_routing_float32()

    @property
    def notices(self) -> Notices:
        """The warnings this layer's model was already given (``apply_`` shares one among the layers it wraps)."""
        notices = self.__dict__.get("condcomp_notices")
        if notices is None:
            notices = self.__dict__["condcomp_notices"] = Notices()
        return notices

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A module pickled with a per-module plan store loads without it (a request's plan lives in its KV cache);
        # one pickled without the scoped settings gets their defaults.
        state.pop("_held", None)
        super().__setstate__(state)
        self.__dict__.setdefault("prompt_len", None)
        self.__dict__.setdefault("budget_fraction", None)
        self.__dict__.setdefault("budget_cap", None)
        self.__dict__.setdefault("condcomp_notices", Notices())

    # --------------------------------------------------------------------------------------------- progress
    def set_progress(self, progress: float, stepped: set[int] | None = None) -> None:
        """Step the components' schedules to training progress in [0, 1] and record it in the buffer.

        ``stepped``: ids of components already stepped to this progress (a policy shared by several layers is
        stepped once).
        """
        p = check_progress(progress)
        with torch.no_grad():
            self.condcomp_progress.copy_(_progress_bits(p))
        self._push_progress(p, stepped if stepped is not None else set())

    @property
    def progress(self) -> float:
        """The training progress last set (or loaded)."""
        return _progress_value(self.condcomp_progress)

    def _push_progress(self, p: float, stepped: set[int]) -> None:
        self._progress_pushed = p
        for component in (self.condcomp_policy, self.condcomp_router):
            step = getattr(component, "set_progress", None)
            if callable(step) and id(component) not in stepped:
                stepped.add(id(component))
                step(p)
        buf = self.condcomp_progress
        self._progress_seen = (buf, tensor_version(buf))

    def _sync_progress(self) -> None:
        # A buffer replaced or written since the last push (load_state_dict, from_pretrained, .to(device)) is
        # pushed to the components; otherwise nothing is read (no device sync per forward).
        if torch.compiler.is_compiling():  # compiled graphs read no version counters; set_progress pushes anyway
            return
        buf = self.condcomp_progress
        seen, version = self._progress_seen
        now = tensor_version(buf)
        if seen is not buf or now is None or version != now:
            self._push_progress(_progress_value(buf), set())

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        # A state_dict without progress buffers (the unwrapped model's, for one) keeps the current progress.
        if prefix + PROGRESS_BUFFER in missing_keys:
            missing_keys.remove(prefix + PROGRESS_BUFFER)

    # --------------------------------------------------------------------------------------------- dtype rule
    def _apply(self, fn: Any, recurse: bool = True) -> RoutingHost:
        if not self.condcomp_progress.is_meta:
            self._sync_progress()
        super()._apply(fn, recurse)
        # The progress is written back from what the components hold: a move keeps it, and to_empty (deferred
        # initialisation), which leaves buffers uninitialised, does not turn it into garbage.
        with torch.no_grad():
            self.condcomp_progress.copy_(_progress_bits(self._progress_pushed))
        self._progress_seen = (self.condcomp_progress, tensor_version(self.condcomp_progress))
        self._keep_routing_float32()
        return self

    def _keep_routing_float32(self) -> None:
        for component in (self.condcomp_policy, self.condcomp_router):
            if isinstance(component, nn.Module) and any(
                t.is_floating_point() and t.dtype != torch.float32
                for t in (*component.parameters(), *component.buffers())
            ):
                component.float()

    # --------------------------------------------------------------------------------------------- routing
    def route(self, x: Tensor, mask: Tensor | None, weights: AttentionWeights, num_keys: int,
              condition: Tensor | None = None) -> HeadPlan:
        """Policy then router on ``x (B, T, D)``; records the decisions for ``head_usage`` and ``aux_loss``.

        ``condition (B, Dc)``: passed to a policy whose ``reads_condition`` is true, as ``condition=``; other
        policies keep the two-argument call of the :class:`~condcomp.BudgetPolicy` protocol and never see it.
        """
        self._sync_progress()
        # Routing decisions (budgets, softmax, top-k) stay in float32 under autocast: a bf16 s or score can move
        # floor(s * H) or flip a top-k tie. Components cast their inputs to float32 themselves.
        B, T = x.shape[:2]
        # Under plan_from_prompt a sequence plan is decided from the prompt only; per-token decisions (a token
        # router, or a per-token budget) see no future anyway and keep every real token.
        decide = mask
        if getattr(self.condcomp_router, "granularity", "sequence") == "sequence":
            decide = decision_mask(mask, self.prompt_len, B, T, x.device)
        with torch.autocast(x.device.type, enabled=False):
            budget: Budget = self._budget(x, decide, condition)
            if decide is not mask and budget.k.dim() == 2:
                decide = mask
                budget = self._budget(x, mask, condition)
            if self.budget_fraction is not None:
                budget = self._fixed_budget(budget, self.budget_fraction)
            plan: HeadPlan = self.condcomp_router(x, decide, budget, weights)
        want = (B, self.layout.num_heads) if plan.granularity == "sequence" else (B, T, self.layout.num_heads)
        if tuple(plan.gates.shape) != want:
            raise ValueError(f"router {type(self.condcomp_router).__name__} returned a {plan.granularity} plan "
                             f"with gates {tuple(plan.gates.shape)}; expected {want}")
        plan = plan.with_aux(budget.aux_losses)
        self.last = LastForward(budget.s.detach(), detached(plan), mask, T, num_keys)
        self._last_aux = plan.aux_losses  # kept with their graph: aux_loss(model) backpropagates through them
        return plan

    def _budget(self, x: Tensor, mask: Tensor | None, condition: Tensor | None) -> Budget:
        if getattr(self.condcomp_policy, "reads_condition", False):
            return self.condcomp_policy(x, mask, condition=condition)  # type: ignore[no-any-return]
        return self.condcomp_policy(x, mask)  # type: ignore[no-any-return]

    def _budget_rule(self) -> tuple[int, int, Any]:
        policy = self.condcomp_policy
        return self.layout.num_heads, int(getattr(policy, "k_min", 1)), getattr(policy, "rounding", "floor")

    def budget_cap_of(self, fraction: float) -> int:
        """The ``k_cap`` :func:`condcomp.budget` declares at ``fraction`` for this layer (its policy's rounding and
        ``k_min``): computed on the host when the block opens, so that ``torch.compile`` specialises an int (a
        changed fraction recompiles) instead of tracing the fraction as a symbol that host rounding cannot take."""
        return budget_k_bound(fraction, *self._budget_rule())

    def _fixed_budget(self, budget: Budget, fraction: float) -> Budget:
        # condcomp.budget: the policy's budget shape and rounding rule, every row at the given fraction, no
        # auxiliary losses (the policy did not choose it)
        s = torch.full_like(budget.s, fraction)
        k = budget_k(s, *self._budget_rule())
        bound = self.budget_cap if self.budget_cap is not None else self.budget_cap_of(fraction)
        return Budget(s=s, k=k, imposed=True, k_cap=bound, k_floor=bound)

    def aux_losses(self) -> dict[str, Tensor]:
        """The last forward's (weighted) auxiliary losses, with their autograd graph."""
        return self.__dict__.get("_last_aux", {})

    def head_usage(self) -> HeadUsage | None:
        """``HeadUsage`` of the last forward, or None before the first one."""
        last = self.last
        if last is None:
            return None
        s, plan, mask = last.s.float(), last.plan, last.mask
        counts = plan.counts.float() / plan.num_heads
        real = mask.bool() if mask is not None else None
        if plan.granularity == "token" and real is not None:
            counts = counts[real]
        k_frac = float(counts.mean()) if counts.numel() else 0.0
        if s.dim() == 2 and real is not None:
            s = s[real]
        s_mean = float(s.mean()) if s.numel() else 0.0
        extra = routing_flops(self.condcomp_policy, last.T) + routing_flops(self.condcomp_router, last.T)
        flops = flop_fraction(self.layout, plan, last.T, last.S, extra)
        streamed_frac = 0.0
        if last.streamed is not None:  # streamed heads are computed too, over at most window_keys keys
            streamed = last.streamed.float().sum(-1) / plan.num_heads  # (B,)
            streamed_frac = float(streamed.mean()) if streamed.numel() else 0.0
            k_frac += streamed_frac
            dense = dense_flops(self.layout, last.T, last.S) * plan.gates.shape[0]
            window = min(last.S, last.window_keys)
            if dense:
                flops += float(plan_flops(self.layout, plan_from_active(last.streamed), last.T, window).sum() / dense)
        if last.held_full is not None and last.held_full.any():  # computed over every key, as kept heads are
            k_frac += float(last.held_full.float().sum(-1).mean()) / plan.num_heads
            dense = dense_flops(self.layout, last.T, last.S) * plan.gates.shape[0]
            if dense:
                flops += float(plan_flops(self.layout, plan_from_active(last.held_full), last.T, last.S).sum() / dense)
        return HeadUsage(s_mean, k_frac, flops, last.executor, last.strategy, streamed_frac)


def detached(plan: HeadPlan) -> HeadPlan:
    """The plan without autograd history or auxiliary losses (what ``head_usage`` keeps)."""
    return HeadPlan(plan.granularity, plan.gates.detach(), plan.active, plan.counts, plan.order, {}, plan.k_cap,
                    plan.shared_heads)


_BUDGET_FRACTION = real("fraction", at_least=0, at_most=1, meaning="of each layer's heads")


def check_budget_fraction(hosts: dict[str, RoutingHost], fraction: float) -> None:
    """Refuse a ``condcomp.budget`` fraction that is not a number in [0, 1], or that a layer of ``hosts`` (by name)
    cannot give: fewer heads than its router always computes (a router's ``fewest_heads``: MoH's and norm's shared
    heads), naming the fraction it would give instead."""
    _BUDGET_FRACTION.check("condcomp.budget", fraction)
    for name, host in hosts.items():
        policy, H = host.condcomp_policy, host.layout.num_heads
        k = int(budget_k(torch.tensor([float(fraction)]), H, int(getattr(policy, "k_min", 1)),
                         getattr(policy, "rounding", "floor"))[0])
        fewest = int(getattr(host.condcomp_router, "fewest_heads", 0))
        if k < fewest:
            router = getattr(type(host.condcomp_router), "registry_key", type(host.condcomp_router).__name__)
            raise ValueError(f"condcomp.budget: fraction {fraction} asks {k} of the {H} heads of layer {name!r}, but "
                             f"its {router} router always computes {fewest} heads (its shared heads), so the fraction "
                             f"would be {fewest / H:g}, not {fraction}; ask for {fewest / H:g} or more, or wrap the "
                             f"model with fewer shared_heads")
