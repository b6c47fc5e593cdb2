"""MoH (Mixture-of-Head attention) router: shared heads always on, per-token Top-K of the routed heads,
two-stage weights and the load-balance loss."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from condcomp.options import Option, check_options, count, flag, real
from condcomp.plans import plan_from_active, top_k_mask
from condcomp.registry import register_router
from condcomp.relaxations import soft_threshold, soft_topk_mask
from condcomp.types import AttentionWeights, Budget, HeadPlan

GATE_NORMS = ("released", "paper")
MOH_GATES = ("weighted", "binary")
BALANCES = ("per_layer", "released")


def resolve_heads(owner: str, num_heads: int, shared_heads: int | None, top_k: int | None) -> tuple[int, int]:
    """``(h_s, K)`` with the defaults (``h_s = H // 2``, ``K = (H - h_s) // 2``, at least 1) and their checks."""
    hs = num_heads // 2 if shared_heads is None else int(shared_heads)
    routed = num_heads - hs
    if hs < 0 or hs > num_heads:
        raise ValueError(f"{owner}: shared_heads must be in [0, num_heads={num_heads}], got {hs}")
    K = (max(1, routed // 2) if routed else 0) if top_k is None else int(top_k)
    if K < 0:
        raise ValueError(f"{owner}: top_k must be >= 0, got {K}")
    if hs + K > num_heads:
        raise ValueError(f"{owner}: shared_heads + top_k = {hs} + {K} exceeds the layer's {num_heads} heads; "
                         f"top_k counts routed heads only, so it can be at most {routed}")
    if hs + K == 0:
        raise ValueError(f"{owner}: top_k = 0 with no shared heads leaves every token without heads; "
                         "set shared_heads > 0 or top_k > 0")
    return hs, K


HEAD_OPTIONS: tuple[Option, ...] = (
    count("shared_heads", optional=True, meaning="heads always on; None: H // 2"),
    count("top_k", optional=True, meaning="routed heads per token; None: (H - shared_heads) // 2"),
)


def check_head_options(owner: str, shared_heads: int | None, top_k: int | None) -> None:
    """Config-time checks that do not need the layer's head count."""
    check_options(owner, HEAD_OPTIONS, {"shared_heads": shared_heads, "top_k": top_k})
    if shared_heads == 0 and top_k == 0:
        raise ValueError(f"{owner}: top_k = 0 with no shared heads leaves every token without heads; "
                         "set shared_heads > 0 or top_k > 0")


def routed_counts(budget: Budget, shape: tuple[int, int], num_heads: int, shared: int, top_k: int) -> Tensor:
    """Routed heads per token ``(B, T)``: ``top_k`` where a policy's budget is full (``k = H``), else ``k - h_s``.

    A policy's ``k`` counts all heads, shared ones included, so a learned or fixed budget below ``H`` leaves
    ``clamp(k - h_s, 0, H - h_s)`` routed heads (the shared heads stay on even when ``k < h_s``). An imposed
    budget (``condcomp.budget``) is obeyed as is, ``k = H`` included (every head), so its count never falls as
    the fraction grows.
    """
    k = budget.k
    if k.dim() == 1:
        k = k.unsqueeze(1).expand(shape)  # (B, T)
    routed = num_heads - shared
    by_budget = (k - shared).clamp(0, routed)
    if budget.imposed:
        return by_budget
    return torch.where(k >= num_heads, torch.full_like(k, top_k), by_budget)


def routed_bound(budget: Budget, num_heads: int, shared: int, top_k: int) -> int:
    """The most routed heads :func:`routed_counts` can give one token under ``budget``, from what the budget declares
    before the call (``k_cap``, ``k_floor``; a Python int, no device read).

    >>> routed_bound(Budget(torch.ones(1), torch.full((1,), 8), k_cap=8, k_floor=8), 8, 4, 2)  # full: top_k
    2
    >>> routed_bound(Budget(torch.ones(1), torch.full((1,), 6), k_cap=6, k_floor=6), 8, 4, 2)  # fixed 0.75: 6 - 4
    2
    >>> routed_bound(Budget(torch.ones(1), torch.full((1,), 8), k_cap=8), 8, 4, 2)  # k may be 7: 3 routed
    3
    """
    E = num_heads - shared
    cap = num_heads if budget.k_cap is None else min(budget.k_cap, num_heads)
    if budget.imposed:
        return min(max(cap - shared, 0), E)
    if budget.k_floor is not None and budget.k_floor >= num_heads:  # every row at k = H: MoH's own top_k
        return top_k
    below = min(max(min(cap, num_heads - 1) - shared, 0), E)  # rows with k < H take k - h_s
    return max(top_k, below) if cap >= num_heads else below


@register_router("moh")
class MoHRouter(nn.Module):
    """Per-token routing of MoH (arXiv 2410.11842): the first ``shared_heads`` heads always on, Top-K of the rest.

    With ``[a1, a2] = softmax(W_h x)``, shared gates ``a1 * softmax(W_s x)`` and routed gates
    ``a2 * softmax(W_r x)`` on the token's Top-K (zero elsewhere): ``gate_norm="paper"``. ``"released"``
    (default; the authors' code) renormalises the routed gates over the Top-K and multiplies them by K, the
    shared ones by ``h_s`` and the stage weights by 2, so uniform routing gives every head a gate near 1, as in
    plain multi-head attention. ``two_stage=False`` drops ``W_h`` (``a1 = a2 = 1``). ``gates="binary"`` uses
    0/1 gates whose gradient is that of the weighted ones (straight-through).

    ``aux_losses["load_balance"] = load_balance * sum_i f_i P_i`` over the routed heads (``balance="per_layer"``,
    the default), with ``f_i`` the fraction of real tokens that picked head i and ``P_i`` its mean routing
    probability. At uniform routing ``sum_i f_i P_i = K / E`` (E = H - h_s routed heads); a collapse onto K heads
    gives 1. ``aux_loss(model)`` sums the layers' terms.

    ``balance="released"`` weights it as the released MoH training scripts do: the model adds
    ``load_balance * mean over routed layers of E * sum_i f_i P_i``. A router sees one layer, so each layer
    contributes ``load_balance * E * sum_i f_i P_i / balance_layers`` and the sum over layers that
    ``aux_loss(model)`` takes is that mean; ``balance_layers`` (required then) is the number of layers routed
    by MoH in the model.

    Budget: with the ``full`` policy (k = H) K = ``top_k``; otherwise, and always under ``condcomp.budget``,
    K = ``clamp(k - h_s, 0, E)`` per example or token, and in training a learned ``s`` gets the task gradient
    through a straight-through soft Top-K mask (all heads computed then). Padding tokens (mask False) get no
    heads. Defaults: ``h_s = H // 2``, ``K = (H - h_s) // 2`` (75 % of heads active, MoH-LLaMA3's ratio).

    The plan declares its shape before the call (``HeadPlan.shared_heads = h_s``, ``HeadPlan.k_cap = h_s`` + the most
    routed heads the budget allows, :func:`routed_bound`), so the gathered executor's capturable token path runs it
    without a host read; the router itself reads nothing back either (no ``.item()``, ``nonzero`` or loop over rows).
    With a learned budget in training every head of a real token is computed, so then every head is declared shared.

    >>> r = MoHRouter(d_model=16, num_heads=8, shared_heads=2, top_k=3)
    >>> r(torch.randn(2, 5, 16), None, Budget(torch.ones(2), torch.full((2,), 8)), None).counts.unique().tolist()
    [5]
    """

    granularity = "token"
    options: ClassVar[tuple[Option, ...]] = (
        *HEAD_OPTIONS,
        flag("two_stage", meaning="the shared/routed stage weights"),
        real("load_balance", at_least=0, meaning="the load-balance loss weight beta"),
        real("mask_temperature", above=0, meaning="the soft top-k mask's temperature"),
        count("balance_layers", at_least=1, optional=True, meaning="layers routed by MoH, for balance='released'"),
    )

    def __init__(self, d_model: int, num_heads: int, shared_heads: int | None = None, top_k: int | None = None,
                 gate_norm: str = "released", two_stage: bool = True, gates: str = "weighted",
                 load_balance: float = 0.01, mask_temperature: float = 0.25, balance: str = "per_layer",
                 balance_layers: int | None = None) -> None:
        super().__init__()
        self.validate_options(shared_heads=shared_heads, top_k=top_k, gate_norm=gate_norm, gates=gates,
                              load_balance=load_balance, mask_temperature=mask_temperature, balance=balance,
                              balance_layers=balance_layers)
        self.num_heads = num_heads
        self.shared_heads, self.top_k = resolve_heads("moh router", num_heads, shared_heads, top_k)
        self.routed_heads = num_heads - self.shared_heads
        self.gate_norm, self.gates, self.load_balance = gate_norm, gates, float(load_balance)
        self.mask_temperature = float(mask_temperature)
        self.balance, self.balance_layers = balance, balance_layers
        # Stage weights only mean something when both kinds of heads exist.
        self.two_stage = bool(two_stage) and self.shared_heads > 0 and self.routed_heads > 0
        self.w_s = nn.Linear(d_model, self.shared_heads, bias=False) if self.shared_heads > 1 else None
        self.w_r = nn.Linear(d_model, self.routed_heads, bias=False) if self.routed_heads > 0 else None
        self.w_h = nn.Linear(d_model, 2, bias=False) if self.two_stage else None

    @staticmethod
    def validate_options(shared_heads: int | None = None, top_k: int | None = None, gate_norm: str = "released",
                         gates: str = "weighted", load_balance: float = 0.01, mask_temperature: float = 0.25,
                         balance: str = "per_layer", balance_layers: int | None = None, **_: Any) -> None:
        check_head_options("moh router", shared_heads, top_k)
        if gate_norm not in GATE_NORMS:
            raise ValueError(f"moh router: gate_norm must be one of {GATE_NORMS}, got {gate_norm!r}")
        if gates not in MOH_GATES:
            raise ValueError(f"moh router: gates must be one of {MOH_GATES}, got {gates!r}")
        check_options("moh router", MoHRouter.options, {"load_balance": load_balance,
                                                        "mask_temperature": mask_temperature,
                                                        "balance_layers": balance_layers})
        if balance not in BALANCES:
            raise ValueError(f"moh router: balance must be one of {BALANCES}, got {balance!r}")
        if balance == "released" and (balance_layers is None or int(balance_layers) < 1):
            raise ValueError("moh router: balance='released' averages the load balance over the model's routed "
                             f"layers; set balance_layers to their number (>= 1), got {balance_layers!r}")
        if balance == "per_layer" and balance_layers is not None:
            raise ValueError("moh router: balance_layers only applies to balance='released'")

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights | None) -> HeadPlan:
        B, T, _ = x.shape
        hs, E = self.shared_heads, self.routed_heads
        xf = x.float()
        rows = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.bool()  # (B, T)
        K = routed_counts(budget, (B, T), self.num_heads, hs, self.top_k).masked_fill(~rows, 0)  # (B, T)
        stage = 2.0 if self.gate_norm == "released" else 1.0
        if self.w_h is not None:
            a = torch.softmax(self.w_h(xf), dim=-1) * stage  # (B, T, 2)
            a1, a2 = a[..., :1], a[..., 1:]
        else:
            a1 = a2 = xf.new_ones(B, T, 1)
        learned = self.training and budget.s.requires_grad
        parts_gate, parts_sel = [], []
        aux: dict[str, Tensor] = {}
        if hs:
            shared = torch.softmax(self.w_s(xf), dim=-1) if self.w_s is not None else xf.new_ones(B, T, 1)
            if self.gate_norm == "released":
                shared = shared * hs
            parts_gate.append(a1 * shared)  # (B, T, hs)
            parts_sel.append(rows.unsqueeze(-1).expand(B, T, hs))
        if E:
            assert self.w_r is not None
            logits = self.w_r(xf)  # (B, T, E)
            probs = torch.softmax(logits, dim=-1)
            sel = top_k_mask(logits, K)  # (B, T, E); K is already 0 on padding
            routed = probs.masked_fill(~sel, 0.0)
            if self.gate_norm == "released":
                routed = routed / routed.sum(-1, keepdim=True).clamp_min(1e-9) * sel.sum(-1, keepdim=True)
            routed = a2 * routed
            if learned:
                # A learned budget: an extra straight-through term (value 0) lets the task loss move s.
                b = soft_threshold(_per_token(budget.s, T), K, self.num_heads)  # (B, T)
                soft = soft_topk_mask(logits, b, self.mask_temperature)
                full = (budget.k if budget.k.dim() == 2 else budget.k.unsqueeze(1)) >= self.num_heads  # (B, T)
                soft = soft.masked_fill(full.unsqueeze(-1) | ~rows.unsqueeze(-1), 0.0)
                routed = routed + (soft - soft.detach())
            parts_gate.append(routed)
            parts_sel.append(sel)
            lb = load_balance_loss(probs, sel, rows)
            if self.balance == "released":
                assert self.balance_layers is not None
                lb = lb * (E / self.balance_layers)
            aux["load_balance"] = self.load_balance * lb
        gates = torch.cat(parts_gate, dim=-1)  # (B, T, H)
        selected = torch.cat(parts_sel, dim=-1)  # (B, T, H)
        # With a learned budget every head of a real token is computed in training, so unselected heads can
        # pass the task gradient to s; their gate value stays 0.
        active = rows.unsqueeze(-1).expand(B, T, self.num_heads) if learned else selected
        if self.gates == "binary":
            hard = selected.float()
            gates = hard + (gates - gates.detach()) if self.training else hard
        if learned:
            return plan_from_active(active, gates, aux, self.num_heads, self.num_heads)
        cap = hs + (routed_bound(budget, self.num_heads, hs, self.top_k) if E else 0)
        return plan_from_active(active, gates, aux, cap, hs)

    @property
    def fewest_heads(self) -> int:
        """Heads computed for every real token whatever the budget (the shared ones): ``condcomp.budget`` refuses a
        fraction below them."""
        return self.shared_heads

    def routing_flops(self, T: int) -> float:
        """Per example: the three gate projections on every token (softmax and top-k ignored)."""
        return 2.0 * T * sum(p.numel() for p in self.parameters())


def _per_token(s: Tensor, T: int) -> Tensor:
    return s if s.dim() == 2 else s.unsqueeze(1).expand(-1, T)


def load_balance_loss(probs: Tensor, selected: Tensor, rows: Tensor) -> Tensor:
    """``sum_i f_i P_i`` over routed heads, averaged over real tokens (``rows (B, T)``).

    ``f_i``: fraction of real tokens whose Top-K holds head i (no gradient); ``P_i``: mean probability of head i.

    >>> p = torch.full((1, 4, 4), 0.25)
    >>> sel = torch.tensor([[[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]]]).bool()
    >>> float(load_balance_loss(p, sel, torch.ones(1, 4, dtype=torch.bool)))  # K / E = 2 / 4
    0.5
    """
    w = rows.to(probs.dtype).unsqueeze(-1)  # (B, T, 1)
    n = w.sum().clamp_min(1.0)
    f = (selected.to(probs.dtype) * w).sum((0, 1)) / n  # (E,)
    P = (probs * w).sum((0, 1)) / n  # (E,)
    return (f * P).sum()
