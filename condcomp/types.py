"""The carriers passed between roles: Budget, HeadPlan, HeadUsage, AttentionWeights, AttentionInputs, Projections.

Shape letters: B batch, T query tokens, S key tokens, D model width, H query heads, Hkv key/value heads,
Dh head width, k active heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.rotary import apply_rotary

Granularity = Literal["sequence", "token"]


@dataclass(frozen=True)
class Budget:
    """How many heads each row may use: the fraction ``s`` and the integer ``k``.

    ``s`` and ``k`` are ``(B,)`` for a per-example budget or ``(B, T)`` for a per-token budget.
    ``aux_losses`` holds already-weighted auxiliary losses (for example the budget hinge).
    ``imposed``: ``k`` was set from outside the policy (``condcomp.budget``), so a router with a count of its own
    at the full budget (MoH's ``top_k``) obeys ``k`` as is: ``k = H`` then means every head.
    ``k_cap``: a bound on every row's ``k`` that the policy declares before seeing data (a Python int: ``fixed``
    knows its k, ``full`` is H), or None (no bound but H). Routers carry it into the plan (``HeadPlan.k_cap``),
    where the gathered executor's capturable path sizes its work by it instead of reading the plan back.
    ``k_floor``: a bound below every row's ``k`` declared the same way (``full``: H, ``fixed``: its k), or None (0).
    MoH's router reads it: at ``k = H`` a token takes MoH's own ``top_k`` routed heads, so with ``k_floor = H`` it
    can declare ``top_k`` routed heads per token as its plan's bound.

    >>> b = Budget(s=torch.tensor([0.5]), k=torch.tensor([4]))
    >>> b.granularity
    'sequence'
    """

    s: Tensor
    k: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    imposed: bool = False
    k_cap: int | None = None
    k_floor: int | None = None

    def __post_init__(self) -> None:
        for name in ("k_cap", "k_floor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"Budget.{name} must be a non-negative int or None, got {v!r}")
        if self.k_cap is not None and self.k_floor is not None and self.k_floor > self.k_cap:
            raise ValueError(f"Budget.k_floor = {self.k_floor} exceeds Budget.k_cap = {self.k_cap}")

    @property
    def granularity(self) -> Granularity:
        return "sequence" if self.k.dim() == 1 else "token"


@dataclass(frozen=True)
class HeadPlan:
    """Which heads each row computes and with what gate; the only thing an executor obeys.

    - ``gates``: ``(B, H)`` for granularity ``"sequence"`` or ``(B, T, H)`` for ``"token"``. A head's output is
      multiplied by its gate; gates of inactive heads are zero and carry no gradient.
    - ``active``: bool, same shape as ``gates``: the heads that are computed.
    - ``counts``: ``(B,)`` or ``(B, T)`` int64, active heads per row.
    - ``order``: same shape as ``gates``, int64: head indices with the active ones first (ascending), so
      ``order[..., :counts]`` are the selected heads; the gathered executor packs from it.
    - ``aux_losses``: already-weighted auxiliary losses of the router (and policy) for ``aux_loss``.
    - ``k_cap``: sequence plans, a bound on ``counts`` known before the call (from the budget policy:
      ``Budget.k_cap``), or None (H). The gathered executor's capturable path (``sequence.static``) computes
      ``k_cap`` heads per example, padded with gate 0, so its shapes never depend on the plan's values; a plan
      that selects more heads than its ``k_cap`` is an error there. Token plans: a bound on every token's
      ``counts`` (MoH: its shared heads plus the most routed heads a token may take).
    - ``shared_heads``: token plans, how many of the first heads every real token is declared to choose (MoH's
      shared heads; 0: none declared). The capturable token path (``token.static``, ``token.triton``) runs them as
      one dense block and the other heads as routed (token, head) pairs, at most ``k_cap - shared_heads`` per
      token; a token that chose more routed heads is an error there, one that skipped a shared head is still
      exact (its gate is 0).

    Build one with :func:`condcomp.plan_from_active` or :func:`condcomp.plan_top_k`.
    """

    granularity: Granularity
    gates: Tensor
    active: Tensor
    counts: Tensor
    order: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    k_cap: int | None = None
    shared_heads: int = 0

    def __post_init__(self) -> None:
        cap, H = self.k_cap, self.gates.shape[-1]
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= H):
            raise ValueError(f"HeadPlan.k_cap must be an int in [0, H={H}] or None, got {cap!r}")
        shared = self.shared_heads
        if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= H:
            raise ValueError(f"HeadPlan.shared_heads must be an int in [0, H={H}], got {shared!r}")

    @property
    def num_heads(self) -> int:
        return int(self.gates.shape[-1])

    @property
    def head_cap(self) -> int:
        """The most heads any row may select: ``k_cap``, or H without one."""
        return self.num_heads if self.k_cap is None else self.k_cap

    def with_aux(self, extra: dict[str, Tensor]) -> HeadPlan:
        """A copy with more auxiliary losses (keys of ``extra`` win)."""
        return HeadPlan(self.granularity, self.gates, self.active, self.counts, self.order,
                        {**self.aux_losses, **extra}, self.k_cap, self.shared_heads)


@dataclass(frozen=True)
class HeadUsage:
    """Statistics of one layer's last forward, kept apart on purpose (see docs/concepts.md).

    ``s_mean``: predicted budget fraction; ``k_frac``: realised fraction of heads computed; ``flop_frac``:
    analytic FLOPs of the plan (routing included) relative to dense attention; ``executor``: the executor that
    ran it and ``strategy``: the gathered executor's strategy (why a plan did or did not run faster:
    ``condcomp.explain`` says more); ``streamed_frac``: the part of ``k_frac`` that attended only a streaming
    window (sinks + recent tokens) of a KV cache instead of the full context, 0 without one.
    """

    s_mean: float
    k_frac: float
    flop_frac: float
    executor: str | None = None
    strategy: str | None = None
    streamed_frac: float = 0.0


@dataclass(frozen=True)
class HeadLayout:
    """Static shape facts of one attention module."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    causal: bool = False
    dropout_p: float = 0.0
    kdim: int | None = None  # width of the key input when it differs from d_model (cross-attention)
    vdim: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"heads and head width must be positive, got {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class AttentionWeights:
    """Per-call views of an attention module's parameters, in the canonical per-head layout.

    Weights are ``nn.Linear``-style ``(out, in)`` matrices: ``q_weight (H*Dh, D)``, ``k_weight (Hkv*Dh, Dk)``,
    ``v_weight (Hkv*Dh, Dv)``, ``o_weight (D, H*Dh)``. Head ``h`` owns rows ``h*Dh:(h+1)*Dh`` of q, columns
    ``h*Dh:(h+1)*Dh`` of o, and uses key/value head ``h // (H // Hkv)``. They are views of the wrapped module's
    own parameters (slices of a fused projection are fine), never copies.
    """

    layout: HeadLayout
    q_weight: Tensor
    k_weight: Tensor
    v_weight: Tensor
    o_weight: Tensor
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    o_bias: Tensor | None = None
    # Per-head normalisation of queries / keys over Dh, after the projection and before rotary (Qwen3's and
    # Gemma3's q_norm / k_norm): one module shared by every head, so it applies to any selection of heads.
    q_norm: Callable[[Tensor], Tensor] | None = None
    k_norm: Callable[[Tensor], Tensor] | None = None

    def norm_queries(self, q: Tensor) -> Tensor:
        """``q (..., Dh)`` through ``q_norm`` (unchanged without one)."""
        return q if self.q_norm is None else self.q_norm(q)

    def norm_keys(self, k: Tensor) -> Tensor:
        """Freshly projected keys ``k (..., Dh)`` through ``k_norm`` (a KV cache holds them normalised already)."""
        return k if self.k_norm is None else self.k_norm(k)

    def project_queries(self, x: Tensor, rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """All heads' queries ``(B, T, H, Dh)`` for routers that score heads by their queries."""
        q = torch.nn.functional.linear(x, self.q_weight, self.q_bias)
        q = self.norm_queries(q.unflatten(-1, (self.layout.num_heads, self.layout.head_dim)))  # (B, T, H, Dh)
        if rotary is not None:
            q = apply_rotary(q.transpose(1, 2), *rotary).transpose(1, 2)
        return q


@dataclass(frozen=True)
class AttentionInputs:
    """One attention call in canonical form.

    - ``x``: query input ``(B, T, D)``; ``key``/``value``: ``(B, S, Dk)``/``(B, S, Dv)`` for cross-attention,
      ``None`` for self-attention.
    - ``mask``: ``(B, T)`` bool, True = real query token (what policies pool over and routers route).
    - ``key_mask``: ``(B, S)`` bool, True = a key that may be attended to.
    - ``attn_bias``: additive float mask broadcastable to ``(B, H, T, S)`` (``-inf`` forbids), or None.
    - ``rotary``: ``(cos, sin)`` each ``(B, T, Dh)`` for rotate-half rotary embeddings (query and key positions
      are the same tokens; self-attention only), or None.
    - ``key_states``/``value_states``: precomputed ``(B, Hkv, S, Dh)`` keys/values (a decoder's KV cache); when
      given, executors skip the key/value projections.
    - ``dropout_p``: attention-probability dropout for this call (0 outside training).
    - ``kv_cache``: a decoder request's compact KV cache for this call
      (:class:`~condcomp.executors.cached.CompactKV`: only the plan's key/value groups are cached), or None. Only
      an executor whose ``capabilities.reads_kv_cache`` is set can run such a call (``kv_cache``).
    """

    x: Tensor
    key: Tensor | None = None
    value: Tensor | None = None
    mask: Tensor | None = None
    key_mask: Tensor | None = None
    attn_bias: Tensor | None = None
    rotary: tuple[Tensor, Tensor] | None = None
    key_states: Tensor | None = None
    value_states: Tensor | None = None
    dropout_p: float = 0.0
    kv_cache: Any = None

    @property
    def key_input(self) -> Tensor:
        return self.x if self.key is None else self.key

    @property
    def value_input(self) -> Tensor:
        if self.value is not None:
            return self.value
        return self.key_input

    @property
    def num_keys(self) -> int:
        if self.key_states is not None:
            return int(self.key_states.shape[2])
        return int(self.key_input.shape[1])


Project = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Projections:
    """The layer's projections as the call runs them: ``q``/``k``/``v`` map ``(B, T, D)`` to every head's
    ``(B, T, H*Dh)`` / ``(B, T, Hkv*Dh)``, ``o`` maps ``(B, T, H*Dh)`` to ``(B, T, D)`` with its bias; per-head
    norms over ``Dh`` (Qwen3) or None. A wrapped model passes its modules' own forwards (exact for LoRA); a layer
    with one fused q/k/v projection (GPT-2's ``c_attn``) is built with :meth:`fused`, which runs it once."""

    q: Project
    k: Project
    v: Project
    o: Project
    q_norm: Project | None = None
    k_norm: Project | None = None
    qkv: Callable[[Tensor], tuple[Tensor, ...]] | None = None  # the fused projection split, when the layer has one

    def project(self, x: Tensor) -> tuple[Tensor, ...]:
        """``(q, k, v)`` of every head for ``x (B, T, D)``: ``(B, T, H*Dh)``, ``(B, T, Hkv*Dh)`` twice."""
        return self.qkv(x) if self.qkv is not None else (self.q(x), self.k(x), self.v(x))

    @classmethod
    def fused(cls, qkv: Project, o: Project, widths: tuple[int, int, int]) -> Projections:
        """A layer whose ``qkv`` maps ``(B, T, D)`` to the queries, keys and values side by side (``widths``)."""
        def split(x: Tensor) -> tuple[Tensor, ...]:
            return tuple(qkv(x).split(list(widths), dim=-1))  # views

        return cls(lambda x: split(x)[0], lambda x: split(x)[1], lambda x: split(x)[2], o, qkv=split)

    @classmethod
    def of_weights(cls, w: AttentionWeights) -> Projections:
        """The projections of canonical weights."""
        return cls(lambda x: F.linear(x, w.q_weight, w.q_bias), lambda x: F.linear(x, w.k_weight, w.k_bias),
                   lambda x: F.linear(x, w.v_weight, w.v_bias), lambda y: F.linear(y, w.o_weight, w.o_bias),
                   w.q_norm, w.k_norm)
