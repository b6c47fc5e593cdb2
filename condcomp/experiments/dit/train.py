"""One DiT run: build the variant, train it with flow matching, sample, and measure quality and head use."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import condcomp
from condcomp.api import routed_modules
from condcomp.config import dataclass_from_dict
from condcomp.experiments.dit.classifier import Judge
from condcomp.experiments.dit.flow import flow_matching_loss, sample
from condcomp.experiments.dit.frechet import frechet_distance
from condcomp.experiments.dit.model import PRESETS, DiT, DiTConfig
from condcomp.experiments.dit.variants import variant_config
from condcomp.experiments.progress import progress_bar
from condcomp.resume import ResumeFile, model_identity


@dataclass
class DiTRunSettings:
    """Training and evaluation settings shared by every variant of a study (the record of how numbers were made).

    ``budget_cost``: an extra loss ``budget_cost * mean(s)`` over layers for the learned budgets, a price on heads
    (without one the task loss pulls every budget to ``s_max``). ``ema``: decay of the weight average that is
    sampled from (as DiT does; its decay warms up as ``min(ema, (1 + step) / (10 + step))``).
    ``samples_per_class``: generated images per class for the metrics.
    """

    preset: str = "digits"
    steps: int = 500
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 50
    ema: float = 0.99
    label_drop: float = 0.1
    budget_cost: float = 0.05
    samples_per_class: int = 30
    sample_steps: int = 20
    guidance: float = 2.0
    executor: str = "auto"
    model: dict[str, Any] = field(default_factory=dict)  # overrides of the preset's shape

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise KeyError(f"unknown DiT preset {self.preset!r}; valid: {sorted(PRESETS)}")
        for name in ("steps", "batch_size", "samples_per_class", "sample_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DiT settings: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"DiT settings: ema must be in [0, 1), got {self.ema}")

    def model_config(self) -> DiTConfig:
        return DiTConfig(**{**PRESETS[self.preset], **self.model})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiTRunSettings:
        return dataclass_from_dict(cls, d, "DiT settings")  # type: ignore[no-any-return]


def build(variant: str, settings: DiTRunSettings, seed: int, fraction: float | None = None) -> DiT:
    """The DiT of ``variant``, initialised from ``seed`` (the same initial weights for every variant)."""
    mcfg = settings.model_config()
    torch.manual_seed(seed)
    model = DiT(mcfg)
    config = variant_config(variant, mcfg.num_heads, mcfg.num_layers, mcfg.d_model, settings.executor, fraction)
    if config is not None:
        condcomp.apply_(model, config)
    return model


def train_dit(model: DiT, images: Tensor, labels: Tensor, settings: DiTRunSettings, seed: int,
              desc: str = "train", checkpoint: ResumeFile | None = None,
              checkpoint_every: int = 50) -> tuple[DiT, dict[str, Any]]:
    """Flow-matching training; returns the EMA model (what is sampled) and facts of the run. ``checkpoint``: the
    whole training state (weights, EMA, optimiser, schedule, every random generator, losses) is saved there every
    ``checkpoint_every`` steps and after the last, and resumed from when present (:mod:`condcomp.resume`)."""
    from condcomp.resume import restore_rng

    if checkpoint_every < 1:
        raise ValueError(f"DiT: checkpoint_every must be >= 1, got {checkpoint_every}")
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / settings.warmup))
    ema = copy.deepcopy(model).eval()
    start, done_seconds, losses = 0, 0.0, []
    saved = checkpoint.load() if checkpoint is not None else None
    if saved is not None and checkpoint is not None:
        checkpoint.check_tensors("the model", saved.get("model"), model.state_dict())  # never torch's size error
        checkpoint.check_tensors("the EMA model", saved.get("ema"), ema.state_dict())
        model.load_state_dict(saved["model"])
        ema.load_state_dict(saved["ema"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        start, done_seconds, losses = int(saved["step"]), float(saved["seconds"]), list(saved["losses"])
        restore_rng(saved["rng"], {"batches": g})  # last: the batches, timesteps and routers' noise continue
    budgets: list[Tensor] = []
    hooks = [r.condcomp_policy.register_forward_hook(lambda m, a, out: budgets.append(out.s))
             for r in routed_modules(model).values()
             if settings.budget_cost > 0 and hasattr(r.condcomp_policy, "mlp")]
    N = images.shape[0]
    routed = bool(routed_modules(model))
    bar = progress_bar(total=settings.steps, initial=start, desc=desc)
    t0 = time.perf_counter() - done_seconds
    model.train()
    for step in range(start, settings.steps):
        idx = torch.randint(0, N, (settings.batch_size,), generator=g).to(images.device)
        if routed:
            condcomp.set_progress(model, step / settings.steps)
        loss, _ = flow_matching_loss(model, images[idx], labels[idx], g, settings.label_drop)
        total = loss + condcomp.aux_loss(model) if routed else loss
        if budgets:
            total = total + settings.budget_cost * torch.stack([b.float().mean() for b in budgets]).mean()
            budgets.clear()
        if not torch.isfinite(total):
            raise RuntimeError(f"{desc}: the loss became {float(total)} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        total.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        decay = min(settings.ema, (1 + step) / (10 + step))  # warmed up: early weights do not linger in it
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1.0 - decay)
        losses.append(float(loss.detach()))
        bar.update(1, loss=losses[-1])
        if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == settings.steps):
            checkpoint.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                             "sched": sched.state_dict(), "step": step + 1, "losses": losses,
                             "seconds": time.perf_counter() - t0}, {"batches": g})
    bar.close()
    for h in hooks:
        h.remove()
    if routed_modules(ema):
        condcomp.set_progress(ema, 1.0)
    tail = losses[-max(1, len(losses) // 10):]
    return ema, {"train_seconds": time.perf_counter() - t0, "final_loss": sum(tail) / len(tail)}


def measure(model: DiT, judge: Judge, test: tuple[Tensor, Tensor], settings: DiTRunSettings,
            seed: int) -> tuple[dict[str, Any], Tensor]:
    """Sample ``samples_per_class`` images per class; Fréchet distance, class accuracy, heads per noise level."""
    model.eval()
    device = next(model.parameters()).device
    labels = torch.arange(model.config.num_classes, device=device).repeat_interleave(settings.samples_per_class)
    routed = routed_modules(model)
    per_step: list[dict[str, Any]] = []

    def record(i: int, t: float) -> None:
        usage = condcomp.head_usage(model)
        per_step.append({"t": t, "layers": {name: {"k_frac": u.k_frac, "s_mean": u.s_mean, "flop_frac": u.flop_frac,
                                                   "executor": u.executor} for name, u in usage.items()}})

    t0 = time.perf_counter()
    samples = sample(model, labels, settings.sample_steps, settings.guidance, seed=1000 + seed,
                     on_step=record if routed else None)
    sampling_seconds = time.perf_counter() - t0
    with torch.no_grad():
        fd = frechet_distance(judge.features(samples), judge.features(test[0]))
        acc = float((judge(samples).argmax(1) == labels).float().mean())
    out: dict[str, Any] = {"frechet": fd, "class_accuracy": acc, "sampling_seconds": sampling_seconds,
                           "num_samples": int(labels.numel()), "heads": 1.0, "flop_fraction": 1.0, "s_mean": 1.0}
    if per_step:
        def mean_of(key: str) -> float:
            vals = [lay[key] for st in per_step for lay in st["layers"].values()]
            return sum(vals) / len(vals)

        out.update(heads=mean_of("k_frac"), flop_fraction=mean_of("flop_frac"), s_mean=mean_of("s_mean"),
                   executors=sorted({str(lay["executor"]) for st in per_step for lay in st["layers"].values()}),
                   per_step=per_step)
    return out, samples


def run_one(variant: str, seed: int, settings: DiTRunSettings, data: dict[str, tuple[Tensor, Tensor]],
            judge: Judge, out_dir: Path, fraction: float | None = None, device: str = "cpu",
            checkpoint_every: int = 50) -> dict[str, Any]:
    """Train, sample and measure one variant at one seed; writes ``metrics.json`` and ``samples.pt`` in
    ``out_dir`` and returns the metrics. Training checkpoints to ``out_dir/checkpoint.pt`` every
    ``checkpoint_every`` steps; a run stopped before its metrics resumes there, exactly."""
    model = build(variant, settings, seed, fraction).to(device)
    checkpoint = ResumeFile(out_dir / "checkpoint.pt", {"variant": variant, "seed": seed, "fraction": fraction,
                                                         **settings.to_dict()},
                            owner={"command": "dit", **model_identity(model, variant)})
    ema, facts = train_dit(model, *data["train"], settings, seed, desc=f"{variant} seed{seed}",
                           checkpoint=checkpoint, checkpoint_every=checkpoint_every)
    metrics, samples = measure(ema, judge, data["test"], settings, seed)
    record = {"variant": variant, "seed": seed, "fraction": fraction, **facts, **metrics,
              "settings": settings.to_dict(), "model": settings.model_config().to_dict()}
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(samples.half().cpu(), out_dir / "samples.pt")
    tmp = out_dir / "metrics.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(out_dir / "metrics.json")  # written last and atomically: its presence means the run finished
    checkpoint.remove()
    return record
