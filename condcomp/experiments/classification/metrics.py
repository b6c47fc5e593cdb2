"""Measurements of a trained classifier: analytic FLOPs (embeddings / projections / attention / FFN), latency
(median, batch 1 and 64), peak memory, optional gCO2 (codecarbon's offline tracker).

Latency and memory are measured, never asserted; FLOPs are counted from what each example's plan computes.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from condcomp.api import routed_modules
from condcomp.experiments.classification.model import EncoderClassifier
from condcomp.flops import routing_flops
from condcomp.plans import kv_groups_used
from condcomp.registry import EXECUTORS


def layer_plan_stats(routed: Any) -> dict[str, Tensor]:
    """Per example of the last forward: s, realised head fraction, (token, head) pairs and K/V heads computed,
    and ``head_frac (B, H)``: how often each head ran (0/1 per example, or the share of its real tokens)."""
    last = routed.last
    plan, mask = last.plan, last.mask
    H = plan.num_heads
    B = plan.gates.shape[0]
    real = mask.bool() if mask is not None else torch.ones(B, last.T, dtype=torch.bool, device=plan.active.device)
    lengths = real.sum(1).double()  # (B,)
    s = last.s.float()
    if s.dim() == 2:
        s = (s * real).sum(1) / lengths.clamp_min(1).float()
    if plan.granularity == "sequence":
        k_frac = plan.counts.double() / H  # (B,)
        pairs = plan.counts.double() * lengths
        heads_any = plan.active
        head_frac = plan.active.double()  # (B, H): 1 where the example runs head h
    else:
        counts = plan.counts.double() * real  # (B, T)
        k_frac = counts.sum(1) / (lengths.clamp_min(1) * H)
        pairs = counts.sum(1)
        on_real = plan.active & real.unsqueeze(-1)  # (B, T, H)
        heads_any = on_real.any(1)  # (B, H)
        head_frac = on_real.double().sum(1) / lengths.clamp_min(1).unsqueeze(-1)  # (B, H): share of its tokens
    L = routed.layout
    kv_heads = kv_groups_used(heads_any, L.num_kv_heads).sum(-1).double()  # (B,)
    return {"s": s.double().cpu(), "k_frac": k_frac.cpu(), "pairs": pairs.cpu(), "kv_heads": kv_heads.cpu(),
            "lengths": lengths.cpu(), "head_frac": head_frac.cpu()}


def flops_split(model: EncoderClassifier, stats: dict[str, dict[str, Tensor]]) -> dict[str, float]:
    """Mean analytic FLOPs per example, split by part, from per-layer :func:`layer_plan_stats` over a split.

    Multiply-add = 2 FLOPs; real (non-padding) tokens only; routing FLOPs (policy + router) are counted in
    ``routing``. ``dense_*`` give the same model with every head computed, and ``fraction`` total / dense total.
    """
    cfg = model.config
    D, F, C = cfg.d_model, cfg.d_ff, cfg.num_classes
    routed = routed_modules(model)
    first = next(iter(stats.values()))
    T = first["lengths"]  # (N,)
    n_emb = 3 if cfg.num_segments > 1 else 2
    out = {"embeddings": float((n_emb - 1) * D * T.mean()), "ffn": float(cfg.num_layers * 4 * D * F * T.mean()),
           "classifier": float(2 * D * C + D * T.mean()), "projections": 0.0, "attention": 0.0, "routing": 0.0,
           "dense_projections": 0.0, "dense_attention": 0.0}
    for name, st in stats.items():
        L = routed[name].layout
        Dh, H, Hkv = L.head_dim, L.num_heads, L.num_kv_heads
        Tn = st["lengths"]
        out["projections"] += float((st["pairs"] * 4 * D * Dh + st["kv_heads"] * 4 * Tn * D * Dh).mean())
        out["attention"] += float((st["pairs"] * 4 * Tn * Dh).mean())
        out["dense_projections"] += float((Tn * H * 4 * D * Dh + Hkv * 4 * Tn * D * Dh).mean())
        out["dense_attention"] += float((H * 4 * Tn * Tn * Dh).mean())
        comps = {id(c): c for c in (routed[name].condcomp_policy, routed[name].condcomp_router)}
        out["routing"] += float(sum(routing_flops(c, int(Tn.mean().round())) for c in comps.values()))
    base = out["embeddings"] + out["ffn"] + out["classifier"]
    out["total"] = base + out["projections"] + out["attention"] + out["routing"]
    out["dense_total"] = base + out["dense_projections"] + out["dense_attention"]
    out["fraction"] = out["total"] / out["dense_total"]
    return out


def inference_executor() -> str:
    """The executor timed at inference: ``gathered`` (computes only selected heads) when registered."""
    return "gathered" if "gathered" in EXECUTORS.names() else "auto"


def set_executor(model: nn.Module, name: str) -> dict[str, str]:
    """Set every RoutedAttention's executor; returns the previous ones (for :func:`restore_executor`)."""
    previous = {}
    for n, r in routed_modules(model).items():
        previous[n] = r.executor
        r.executor = name
    return previous


def restore_executor(model: nn.Module, previous: dict[str, str]) -> None:
    for n, r in routed_modules(model).items():
        r.executor = previous.get(n, r.executor)


@torch.no_grad()
def median_latency(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Median wall-clock seconds of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages alive during the mode (CPU has no allocator statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _track(self, t: Tensor) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = st.nbytes()
        self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.device.type != "meta":
                try:
                    self._track(t)
                except (RuntimeError, NotImplementedError):
                    pass  # views of storages without a pointer: nothing new allocated
        return out


@torch.no_grad()
def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak activation bytes of one ``fn()`` call beyond what was allocated before (weights excluded)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated(device) - base)
    mode = _LiveBytes()
    with mode:
        fn()
    return int(mode.peak)


class CarbonTracker:
    """codecarbon's offline tracker when installed (``pip install 'condcomp[carbon]'``); a no-op otherwise."""

    def __init__(self, country: str | None, out_dir: str) -> None:
        self.country, self.tracker, self.reason = country, None, ""
        if not country:
            self.reason = "disabled (pass --carbon-country ISO3 to measure gCO2 offline)"
            return
        try:
            from codecarbon import OfflineEmissionsTracker
        except ImportError:
            self.reason = "codecarbon not installed (pip install 'condcomp[carbon]')"
            return
        import os

        os.makedirs(out_dir, exist_ok=True)  # codecarbon refuses a folder that does not exist yet
        self.tracker = OfflineEmissionsTracker(country_iso_code=country, output_dir=out_dir, log_level="error",
                                               save_to_file=False)

    def __enter__(self) -> CarbonTracker:
        if self.tracker is not None:
            self.tracker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kg = self.tracker.stop() if self.tracker is not None else None

    def result(self) -> dict[str, Any]:
        kg = getattr(self, "kg", None)
        return {"country": self.country, "gco2": None if kg is None else float(kg) * 1000.0, "note": self.reason}
