"""BudgetFormer's head scorer g_phi: noisy, tempered softmax over heads; soft in training, hard top-k at inference."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from condcomp.kv.window import StreamWindow
from condcomp.options import MAX_WIDTH, Option, check_options, count, flag, real, schedule
from condcomp.plans import plan_from_active, plan_top_k, top_k_mask
from condcomp.registry import register_router
from condcomp.relaxations import entropy, masked_mean, rows_with_tokens, soft_threshold, soft_topk_mask
from condcomp.schedules import ScheduleSpec, make_schedule
from condcomp.types import AttentionWeights, Budget, HeadPlan

TrainMode = Literal["straight_through", "soft_topk", "budget_scaled"]
TRAIN_MODES = ("straight_through", "soft_topk", "budget_scaled")
GATE_MODES = ("binary", "weighted", "renormalized")

DEFAULT_TEMPERATURE: dict[str, Any] = {"kind": "exponential", "start": 2.0, "end": 0.5}
DEFAULT_NOISE: dict[str, Any] = {"kind": "linear", "start": 0.5, "end": 0.0}
DEFAULT_ENTROPY_BETA: dict[str, Any] = {"kind": "linear", "start": -0.01, "end": 0.01}
DEFAULT_STREAM_SINKS = 4  # sinks a streamed group keeps when stream_window is set and stream_sinks is not


@register_router("topk")
class TopKRouter(nn.Module):
    """g_phi: scores ``z = W pool(x)`` (one linear layer, or a 2-layer MLP with ``hidden``), one per head.

    Training (``self.training``): ``z~ = z + sigma(t) * N(0, 1)``, ``p = softmax(z~ / tau(t))``, every head is
    computed and the gates stay differentiable in the budget ``s`` and the scores, by ``train_mode``:

    - ``"straight_through"`` (default): forward value = the hard top-k mask (exactly what inference computes),
      gradient = that of the soft mask ``m_h = sigmoid((b - rho_h) / tau_mask)``, with ``rho_h`` the soft rank
      of head h under ``z~ / tau`` and ``b = k + 1/2`` carrying the gradient of ``s H`` (``soft_threshold``).
    - ``"soft_topk"``: the gates are ``m_h`` themselves (smooth, but training sees partial heads).
    - ``"budget_scaled"``: gates ``s * H * p_h`` (total gate mass = the budget; no top-k until inference;
      ``gates`` then only applies at inference).

    ``gates`` (``"binary"`` | ``"weighted"`` | ``"renormalized"``) multiplies that mask by nothing, by ``p_h``, or
    by ``p_h`` renormalised over the kept heads times their count. Evaluation: no noise, hard top-k of ``z``
    with ``budget.k`` heads, the same gate mode (``p`` from ``softmax(z / tau(t))``); deterministic. The
    entropy term ``aux_losses["entropy"] = beta(t) * mean H(p)`` rewards exploration while ``beta < 0`` and
    specialisation once ``beta > 0``. With a per-token budget ``(B, T)`` each token is scored on its own.
    Schedules are specs for :func:`condcomp.schedules.make_schedule`, stepped by ``set_progress``.

    ``kv_groups=True`` chooses whole key/value groups (GQA: the ``r = H / Hkv`` query heads sharing a key/value
    head; MHA: single heads): one score per group, ``ceil(k / r)`` groups kept, every head of a kept group on.
    Budgets then translate into KV-cache savings (a held plan caches kept groups only, :mod:`condcomp.kv.selection`).

    ``stream_window=n`` (with ``stream_sinks``, default 4, which is refused without ``stream_window``; deprecated:
    set ``CondCompConfig(kv=("window", {"sinks": s, "window": n}))``, the KV policy it stands for): at inference with
    a KV cache, the key/value groups a request's plan does not keep are not dropped but streamed: their query heads
    attend to the request's first ``stream_sinks`` tokens and its last ``n`` tokens (gate 1), and the cache holds
    only those for them (:class:`~condcomp.kv.window.StreamWindow`). Without a cache (training) the plan is unchanged.

    ``init_scores`` warm-starts the scorer from a prior ranking (one score per scored unit: a head, or a KV group
    with ``kv_groups``): the scorer's output bias starts at these scores and its output weights at zero, so the
    router starts as static pruning of the lowest-scored units (every input gets the same heads) and training
    learns input-dependent departures from it. Scores a few units apart (noise starts at 0.5) keep the prior's
    choice through early training; e.g. ``[2.0 * (G - 1 - rank_g)]`` from a head-importance ranking.

    >>> r = TopKRouter(d_model=16, num_heads=4).eval()
    >>> budget = Budget(s=torch.tensor([0.5, 1.0]), k=torch.tensor([2, 4]))
    >>> r(torch.randn(2, 3, 16), None, budget, None).counts.tolist()
    [2, 4]
    """

    granularity = "sequence"
    options: ClassVar[tuple[Option, ...]] = (
        count("hidden", at_least=1, at_most=MAX_WIDTH, optional=True, meaning="scorer MLP width; None: linear"),
        schedule("temperature", above=0, meaning="the softmax temperature over training"),
        schedule("noise_std", at_least=0, meaning="the score noise over training"),
        schedule("entropy_beta", meaning="the entropy term's weight over training"),
        real("mask_temperature", above=0, meaning="the soft top-k mask's temperature"),
        flag("kv_groups", meaning="score whole key/value groups"),
        count("stream_window", at_least=1, optional=True, meaning="recent tokens a streamed group keeps"),
        count("stream_sinks", optional=True, meaning="first tokens a streamed group keeps (default 4)"),
    )

    def __init__(self, d_model: int, num_heads: int, hidden: int | None = None,
                 temperature: ScheduleSpec = DEFAULT_TEMPERATURE, noise_std: ScheduleSpec = DEFAULT_NOISE,
                 entropy_beta: ScheduleSpec = DEFAULT_ENTROPY_BETA, train_mode: TrainMode = "straight_through",
                 mask_temperature: float = 0.25, gates: str = "binary", kv_groups: bool = False,
                 num_kv_heads: int | None = None, init_scores: Sequence[float] | None = None,
                 stream_window: int | None = None, stream_sinks: int | None = None) -> None:
        super().__init__()
        self.validate_options(hidden=hidden, temperature=temperature, noise_std=noise_std, entropy_beta=entropy_beta,
                              train_mode=train_mode, mask_temperature=mask_temperature, gates=gates,
                              init_scores=init_scores, stream_window=stream_window, stream_sinks=stream_sinks)
        self.d_model, self.num_heads = d_model, num_heads
        self.kv_groups = bool(kv_groups)
        # groups a request's plan does not keep get a streaming window in its KV cache instead of nothing
        stream_sinks = DEFAULT_STREAM_SINKS if stream_sinks is None else stream_sinks
        self.stream = None if stream_window is None else StreamWindow(stream_sinks, stream_window)
        if self.stream is not None:
            warnings.warn("topk(stream_window=, stream_sinks=) is a shorthand for the window KV policy: set "
                          f"CondCompConfig(kv=('window', {{'sinks': {stream_sinks}, 'window': {stream_window}}})) "
                          "instead", DeprecationWarning, stacklevel=2)
        # heads per scored unit: a KV group's query heads, or 1 (num_kv_heads None: a layer without GQA facts)
        self.group_size = num_heads // (num_kv_heads or num_heads) if self.kv_groups else 1
        units = num_heads // self.group_size
        self.temperature = make_schedule(temperature, "temperature")
        self.noise_std = make_schedule(noise_std, "noise_std")
        self.entropy_beta = make_schedule(entropy_beta, "entropy_beta")
        self.train_mode, self.mask_temperature, self.gates = train_mode, float(mask_temperature), gates
        if hidden is None:
            self.scorer: nn.Module = nn.Linear(d_model, units)
        else:
            self.scorer = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, units))
        if init_scores is not None:
            self._warm_start(init_scores, units)
        self.progress = 0.0
        self._token_level = False

    @staticmethod
    def validate_options(hidden: int | None = None, temperature: ScheduleSpec = DEFAULT_TEMPERATURE,
                         noise_std: ScheduleSpec = DEFAULT_NOISE, entropy_beta: ScheduleSpec = DEFAULT_ENTROPY_BETA,
                         train_mode: str = "straight_through", mask_temperature: float = 0.25, gates: str = "binary",
                         init_scores: Sequence[float] | None = None, stream_window: int | None = None,
                         stream_sinks: int | None = None, **_: Any) -> None:
        check_options("topk router", TopKRouter.options, {
            "hidden": hidden, "temperature": temperature, "noise_std": noise_std, "entropy_beta": entropy_beta,
            "mask_temperature": mask_temperature})
        if train_mode not in TRAIN_MODES:
            raise ValueError(f"topk router: train_mode must be one of {TRAIN_MODES}, got {train_mode!r}")
        if gates not in GATE_MODES:
            raise ValueError(f"topk router: gates must be one of {GATE_MODES}, got {gates!r}")
        if init_scores is not None:
            _check_scores(init_scores)
        if stream_window is None and stream_sinks is not None:  # ignored otherwise: without a window nothing streams
            raise ValueError(f"topk router: stream_sinks={stream_sinks} applies only with stream_window (without it "
                             "the groups a plan does not keep are dropped); set kv=('window', {'sinks': s, 'window': "
                             "n}) instead")

    def _warm_start(self, init_scores: Sequence[float], units: int) -> None:
        """Output layer: weights 0, bias ``init_scores`` (the prior ranking, whatever the input)."""
        if len(init_scores) != units:
            what = "KV groups" if self.kv_groups else "heads"
            raise ValueError(f"topk router: init_scores has {len(init_scores)} scores but the layer has {units} "
                             f"{what} to score")
        last = self.scorer if isinstance(self.scorer, nn.Linear) else list(self.scorer.children())[-1]
        assert isinstance(last, nn.Linear)
        with torch.no_grad():
            last.weight.zero_()
            last.bias.copy_(torch.tensor([float(v) for v in init_scores]))

    def set_progress(self, progress: float) -> None:
        """Move the temperature, noise and entropy schedules to training progress ``p`` in [0, 1]."""
        if not 0.0 <= float(progress) <= 1.0:
            raise ValueError(f"progress must be in [0, 1], got {progress}")
        self.progress = float(progress)

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights | None) -> HeadPlan:
        token_level = budget.k.dim() == 2
        self._token_level = token_level
        r = self.group_size
        cap = budget.k_cap  # the policy's bound on k: the plan's k_cap at inference (training computes every head)
        if r > 1:  # score groups: ceil(k / r) of them hold the budget's k heads
            budget = Budget(budget.s, torch.div(budget.k + r - 1, r, rounding_mode="floor"), budget.aux_losses)
            cap = None if cap is None else -(-cap // r)  # groups
        xf = x.float()
        z = self.scorer(xf if token_level else masked_mean(xf, mask))  # (B, T, H) or (B, H)
        tau = self.temperature(self.progress)
        rows = mask.bool() if (token_level and mask is not None) else None  # real tokens (B, T)
        if self.training:
            sigma = self.noise_std(self.progress)
            if sigma > 0:
                z = z + sigma * torch.randn_like(z)
        logits = z / tau
        probs = torch.softmax(logits, dim=-1)
        counted = rows if token_level else rows_with_tokens(x, mask)  # an empty row or batch trains nothing
        aux = {"entropy": self.entropy_beta(self.progress) * entropy(probs, counted)}
        if not self.training:
            plan = plan_top_k(z, budget.k, gates=self.gates, temperature=tau, mask=rows,  # type: ignore[arg-type]
                              aux_losses=aux, k_cap=None if token_level else cap)
            return plan if r == 1 else plan_from_active(plan.active.repeat_interleave(r, -1),
                                                        plan.gates.repeat_interleave(r, -1), aux,
                                                        None if plan.k_cap is None else plan.k_cap * r)
        gates = self._training_gates(logits, probs, budget).repeat_interleave(r, -1)
        active = torch.ones_like(gates, dtype=torch.bool)
        if rows is not None:
            active = active & rows.unsqueeze(-1)
        return plan_from_active(active, gates, aux)

    def _training_gates(self, logits: Tensor, probs: Tensor, budget: Budget) -> Tensor:
        H = logits.shape[-1]  # heads, or KV groups with kv_groups
        k = budget.k.to(logits.device)
        full = (k >= H).unsqueeze(-1)  # a row at full budget has no choice to make
        if self.train_mode == "budget_scaled":  # already weights: the gate mode applies at inference only
            scaled = budget.s.float().unsqueeze(-1) * H * probs
            return torch.where(full, torch.ones_like(scaled), scaled)
        hard = top_k_mask(logits, k).float()
        soft = soft_topk_mask(logits, soft_threshold(budget.s, k, H), self.mask_temperature)
        mask = hard + (soft - soft.detach()) if self.train_mode == "straight_through" else soft
        mask = torch.where(full, torch.ones_like(mask), mask)  # exact ones: training = the dense model
        if self.gates == "binary":
            return mask
        weighted = mask * probs
        if self.gates == "weighted":
            return weighted
        return weighted / weighted.sum(-1, keepdim=True).clamp_min(1e-9) * mask.sum(-1, keepdim=True)

    def routing_flops(self, T: int) -> float:
        """Per example: pooling plus one scorer evaluation (or one per token for per-token budgets)."""
        params = sum(p.numel() for p in self.scorer.parameters())
        if self._token_level:
            return 2.0 * T * params
        return float(T * self.d_model) + 2.0 * params


def _check_scores(init_scores: Any) -> None:
    """A list or tuple of real numbers, finite in float32 (the scorer's dtype)."""
    if not isinstance(init_scores, (list, tuple)):
        hint = " (a tensor or array: pass .tolist())" if hasattr(init_scores, "tolist") else ""
        raise TypeError(f"topk router: init_scores must be a list of numbers (one per head, or per KV group with "
                        f"kv_groups=True), got {type(init_scores).__name__}{hint}")
    bad = [v for v in init_scores if isinstance(v, bool) or not isinstance(v, numbers.Real)]
    if bad:
        raise TypeError(f"topk router: init_scores must hold numbers, got {bad[:3]!r}")
    if not bool(torch.tensor([float(v) for v in init_scores], dtype=torch.float32).isfinite().all()):
        raise ValueError(f"topk router: init_scores must be finite in float32 (|score| < 3.4e38, no NaN), got "
                         f"{list(init_scores)!r}")
