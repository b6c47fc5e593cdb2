"""The tuning loop of ``condcomp tune-llm`` (the command is in command.py, the study in tuning_study.py).

Every variant is tuned with the same data, steps and method: LoRA on the attention projections (q, k, v, o) plus
the routing parameters, loss on the continuation tokens only (the objective, objectives.py: the language-model loss,
or distillation from the dense model). Resumable: each variant checkpoints its
trainable state, optimiser, schedule, every random generator (:mod:`condcomp.resume`) and step in
``OUT/<variant>/checkpoint.pt``; a rerun continues there, as if never stopped.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

import condcomp
from condcomp.experiments.divergence import flags, stop_if_diverged
from condcomp.experiments.llm.data import LM_DATASETS
from condcomp.experiments.llm.objectives import (
    DEFAULT_KL_WEIGHT,
    DEFAULT_TEMPERATURE,
    check_objective,
    needs_teacher,
    objective_key,
    objective_loss,
)
from condcomp.experiments.progress import progress_bar
from condcomp.options import Option, check_fields, count, real
from condcomp.resume import ResumeFile, model_identity

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class TuneSettings:
    """Sizes and tuning options. The defaults are the run a user would make (about 45 minutes per variant on two
    CPU cores); ``PRESETS["short"]`` is the reduced run of docs/llm.md's table."""

    seq_len: int = 256
    prompt_len: int = 64
    batch_size: int = 4
    steps: int = 300
    lr: float = 1e-3
    router_lr: float | None = None  # the routing parameters' learning rate (None: lr)
    warmup: int = 10
    tune: str = "lora"  # "lora" (peft) | "attention" (the q/k/v/o weights themselves)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    eval_seqs: int = 32  # per dataset, from the test splits
    calib_seqs: int = 16  # per dataset, train-split rows the tuning never sees (static pruning's importance)
    agree_prompts: int = 16
    agree_tokens: int = 16
    samples: int = 2
    checkpoint_every: int = 10
    seed: int = 0
    executor: str = "auto"
    objective: str = "lm"  # "lm" | "kl" | "hidden" | "lm+kl" (objectives.py)
    kl_temperature: float = DEFAULT_TEMPERATURE
    kl_weight: float = DEFAULT_KL_WEIGHT  # kl's share of lm+kl
    datasets: tuple[str, ...] = LM_DATASETS
    # every number, checked by the one option check (condcomp.options) here and, as its flag's type, by tune-llm
    options: ClassVar[tuple[Option, ...]] = (
        count("seq_len", at_least=2), count("prompt_len", at_least=1), count("batch_size", at_least=1),
        count("steps", at_least=1), real("lr", above=0), real("router_lr", above=0, optional=True,
                                                              meaning="None: lr"),
        count("warmup"), count("lora_rank", at_least=1), real("lora_alpha", above=0),
        count("eval_seqs", at_least=1), count("calib_seqs", at_least=1), count("agree_prompts", at_least=1),
        count("agree_tokens", at_least=1), count("samples"), count("checkpoint_every", at_least=1), count("seed"),
        real("kl_temperature", above=0, meaning="1: the model's own distributions"),
        real("kl_weight", at_least=0, at_most=1, meaning="the kl share of lm+kl's loss"),
    )

    def __post_init__(self) -> None:
        self.datasets = tuple(self.datasets)
        check_fields(self, "tune-llm settings")
        if self.tune not in ("lora", "attention"):
            raise ValueError(f"tune-llm settings: tune must be 'lora' or 'attention', got {self.tune!r}")
        if not 0 < self.prompt_len < self.seq_len:
            raise ValueError(f"tune-llm settings: prompt_len ({self.prompt_len}) must be in [1, seq_len - 1 = "
                             f"{self.seq_len - 1}]")
        check_objective(self.objective, self.kl_temperature, self.kl_weight)

    def tuning_key(self) -> dict[str, Any]:
        """The settings a checkpoint must share with the run that resumes it."""
        keep = ("seq_len", "prompt_len", "batch_size", "steps", "lr", "router_lr", "warmup", "tune", "lora_rank",
                "lora_alpha", "calib_seqs", "seed", "datasets")
        # a field left at None is left out: checkpoints written before it existed still match (so is the lm
        # objective, and every objective option that its objective does not use)
        key = {k: v for k, v in asdict(self).items() if k in keep and v is not None}
        return key | objective_key(self.objective, self.kl_temperature, self.kl_weight)


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    # The reduced run: 40 steps of 4 x 256 tokens per variant (3-5 CPU minutes each, one thread).
    "short": {"steps": 40, "warmup": 4, "eval_seqs": 8, "calib_seqs": 4, "checkpoint_every": 5},
}
PRESET_ALIASES = {"session": "short"}  # the name the short preset had first; still accepted


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))  # cosine down to 10 %


def make_trainable(model: nn.Module, settings: TuneSettings) -> nn.Module:
    """Freeze the model, then train LoRA adapters (or the projections themselves) on q/k/v/o plus every routing
    parameter (``condcomp_policy`` / ``condcomp_router``). Returns the model to train (a PEFT model for LoRA)."""
    if settings.tune == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha,  # type: ignore[arg-type]
                                                           lora_dropout=0.0,
                                                           target_modules=list(ATTENTION_PROJECTIONS)))
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        for name, p in model.named_parameters():
            if any(f".{proj}." in name for proj in ATTENTION_PROJECTIONS):
                p.requires_grad_(True)
    for name, p in model.named_parameters():
        if "condcomp_policy" in name or "condcomp_router" in name:
            p.requires_grad_(True)
    return model


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """Name -> detached copy of every parameter that requires a gradient."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def tune(model: nn.Module, train_ids: Tensor, settings: TuneSettings, checkpoint: Path, desc: str = "tune",
         stop_after: int | None = None, teacher: nn.Module | None = None) -> dict[str, Any]:
    """Train ``model``'s trainable parameters on ``train_ids (N, seq_len)``, resuming from ``checkpoint`` when it
    exists; batches follow one seeded order, so a resumed run sees the batches an uninterrupted one would.

    ``stop_after``: return after that many steps of this call (a checkpoint is written). ``teacher``: the dense
    model as loaded, for the distillation objectives (``settings.objective``). Returns the record: step reached,
    seconds spent over all calls, and the loss history (the objective's loss and its parts).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("tune: the model has no trainable parameter")
    if needs_teacher(settings.objective) and teacher is None:
        raise ValueError(f"tune: the {settings.objective} objective needs the teacher (the dense model as loaded)")
    opt, sched = _optimizer(model, settings)
    resume = _resume_file(checkpoint, model, settings)  # what the run belongs to, taken once before it trains
    state = _resume(resume, model, opt, sched, settings)
    order = _order(train_ids.shape[0], settings)
    routed = bool(condcomp.routed_modules(model))
    bar = progress_bar(settings.steps, initial=state["step"], desc=desc)
    done_here = 0
    try:
        while state["step"] < settings.steps and (stop_after is None or done_here < stop_after):
            step = state["step"]
            started, cpu_started = time.perf_counter(), time.process_time()
            batch = train_ids[order[step * settings.batch_size:(step + 1) * settings.batch_size]]
            loss, aux, parts = _train_step(model, teacher, batch, step, settings, opt, sched, params, routed)
            stop_if_diverged(step + 1, {"loss": loss, "aux": aux}, params, _diverging_settings(settings))
            state["step"] = step + 1
            state["seconds"] += time.perf_counter() - started  # wall clock: includes pauses on a shared machine
            state["cpu_seconds"] += time.process_time() - cpu_started  # this process's CPU time, all threads
            state["history"].append({"step": step + 1, "loss": loss, "aux": aux, **parts})
            done_here += 1
            bar.update(1, loss=loss)
            if state["step"] % settings.checkpoint_every == 0 or state["step"] == settings.steps:
                _save(resume, model, opt, sched, state)
        if done_here and state["step"] % settings.checkpoint_every and state["step"] != settings.steps:
            _save(resume, model, opt, sched, state)
    finally:
        bar.close()
    return state


def _diverging_settings(s: TuneSettings) -> str:
    """What a diverged run names: the learning rates, and the temperature when the objective distils."""
    return flags(asdict(s), "lr", "router_lr", *(("kl_temperature",) if "kl" in s.objective else ()))


def _optimizer(model: nn.Module, settings: TuneSettings) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable parameters and its warm-up/decay schedule; the routing parameters in a second
    group only when ``router_lr`` is set (checkpoints expect one group otherwise)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups: list[dict[str, Any]] = [{"params": params}]
    if settings.router_lr is not None:  # the LambdaLR schedule scales both groups alike
        routing = {id(p) for n, p in named if "condcomp_policy" in n or "condcomp_router" in n}
        groups = [{"params": [p for p in params if id(p) not in routing]}]
        if routing:
            groups.append({"params": [p for p in params if id(p) in routing], "lr": settings.router_lr})
    opt = torch.optim.AdamW(groups, lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, settings.steps, settings.warmup))
    return opt, sched


def _resume(resume: ResumeFile, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
            settings: TuneSettings) -> dict[str, Any]:
    """The tuning state: read back from ``resume`` (a ResumeFile: weights, optimiser, schedule, every random
    generator) when it exists, else a fresh one with the seeded generator."""
    from condcomp.resume import restore_rng

    checkpoint = resume.path
    saved = resume.read()
    if saved is None:
        torch.manual_seed(settings.seed)
        return {"step": 0, "seconds": 0.0, "cpu_seconds": 0.0, "history": []}
    was, now = saved["settings"].get("objective", "lm"), settings.objective
    if was != now:  # said apart from the other settings: resuming would mix two objectives in one run
        raise ValueError(f"{checkpoint} was tuned with the {was} objective, this run asks for {now}: resuming would "
                         f"mix the two; use another --out (or --objective {was}), or delete it to start over")
    resume.check(saved)  # another model, other settings: refused, each difference named
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    resume.check_tensors("the trainable parameters", saved.get("trainable"),
                         {n: p for n, p in model.named_parameters() if n in names})
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in names:
                p.copy_(saved["trainable"][n])
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    restore_rng(saved["rng"])
    kept = ("step", "seconds", "cpu_seconds", "history")
    return {"cpu_seconds": 0.0, **{k: saved[k] for k in kept if k in saved}}


def _train_step(model: nn.Module, teacher: nn.Module | None, batch: Tensor, step: int, settings: TuneSettings,
                opt: torch.optim.Optimizer, sched: Any, params: list[nn.Parameter],
                routed: bool) -> tuple[float, float, dict[str, float]]:
    """One optimiser step on ``batch (B, seq_len)``; returns the objective's loss on the continuation, the
    auxiliary loss, and the objective's parts (objectives.objective_loss)."""
    if routed:
        condcomp.set_progress(model, step / settings.steps)
    model.train()
    loss, parts = objective_loss(model, teacher, batch, settings.prompt_len, settings.objective,
                                 settings.kl_temperature, settings.kl_weight)
    aux = condcomp.aux_loss(model) if routed else torch.zeros(())
    opt.zero_grad(set_to_none=True)
    (loss + aux).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    return float(loss.detach()), float(aux.detach()), parts


def _order(n: int, settings: TuneSettings) -> Tensor:
    """Row indices for every step: seeded permutations of the rows, concatenated as often as needed."""
    g = torch.Generator().manual_seed(settings.seed)
    need = settings.steps * settings.batch_size
    return torch.cat([torch.randperm(n, generator=g) for _ in range(-(-need // n))])[:need]


def _resume_file(path: Path, model: nn.Module, settings: TuneSettings) -> ResumeFile:
    """The checkpoint of tuning ``model`` (its name, config and shapes recorded) with ``settings``."""
    return ResumeFile(path, settings.tuning_key(), owner={"command": "tune-llm", **model_identity(model)})


def _save(resume: ResumeFile, model: nn.Module, opt: Any, sched: Any, state: dict[str, Any]) -> None:
    # written aside and renamed: a run stopped while saving keeps the previous checkpoint
    resume.save({"trainable": trainable_state(model), "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict(), **state})


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy (each variant starts from the same dense weights)."""
    return copy.deepcopy(model)


def dump_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
