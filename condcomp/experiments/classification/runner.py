"""One run end to end (prepare, build, train, evaluate, measure, write metrics.json), eval of a checkpoint."""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

import condcomp
from condcomp.experiments.classification.batches import EncodedSplit, on_device
from condcomp.experiments.classification.metrics import (
    CarbonTracker,
    flops_split,
    inference_executor,
    median_latency,
    peak_memory_bytes,
    restore_executor,
    set_executor,
)
from condcomp.experiments.classification.model import EncoderClassifier, ModelConfig
from condcomp.experiments.classification.runconfig import (
    PreparedDataset,
    RunConfig,
    model_config,
    prepare,
    seed_everything,
)
from condcomp.experiments.classification.train import build_model, evaluate, train


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    tmp.replace(path)


def environment() -> dict[str, Any]:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "condcomp": condcomp.__version__}


@torch.no_grad()
def measure(model: EncoderClassifier, split: EncodedSplit, reps: int = 20) -> dict[str, Any]:
    """Latency (median s; batch 1 and 64) and peak activation memory (batch 64) with the inference executor."""
    model.eval()
    device = next(model.parameters()).device
    name = inference_executor()
    previous = set_executor(model, name)
    out: dict[str, Any] = {"executor": name}
    try:
        for bs in (1, 64):
            ids, mask, seg, _ = on_device(next(split.batches(min(bs, len(split)))), device)
            out[f"latency_b{bs}"] = median_latency(partial(model, ids, mask, seg), reps)
        ids, mask, seg, _ = on_device(next(split.batches(min(64, len(split)))), device)
        out["peak_mem_b64"] = peak_memory_bytes(lambda: model(ids, mask, seg), ids.device)
    finally:
        restore_executor(model, previous)
    return out


def summarize(model: EncoderClassifier, ev: dict[str, Any], timing: dict[str, Any] | None) -> dict[str, Any]:
    """The metrics row of a model: accuracy, s_mean, realised heads, FLOPs split, timing (examples kept aside)."""
    stats = ev.pop("_stats")
    row = {k: v for k, v in ev.items() if k != "examples"}
    row["flops"] = flops_split(model, stats)
    row["flop_frac"] = row["flops"]["fraction"]
    if timing:
        row.update(timing)
    return row


def run_single(cfg: RunConfig, out: Path, resume: bool = False, prep: PreparedDataset | None = None,
               tokenizer: Any = None, name: str | None = None) -> tuple[dict[str, Any], EncoderClassifier]:
    """Train one method and write ``out/metrics.json`` (+ ``out/examples.json``, ``out/checkpoint/``)."""
    t0 = time.perf_counter()
    if prep is None:
        prep, tokenizer = prepare(cfg)
    mcfg = model_config(cfg, prep)
    seed_everything(cfg.seed)
    model = build_model(mcfg, cfg)
    meta = {"run": cfg.to_dict(), "model": mcfg.to_dict()}
    ckpt = out / "checkpoint"
    if tokenizer is not None and cfg.tokenizer == "trained":
        ckpt.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(ckpt / "tokenizer.json"))
    with CarbonTracker(cfg.carbon_country, str(out)) as carbon_train:
        state = train(model, prep.train, cfg, ckpt, resume, meta, desc=name or cfg.method)
    _warn_unless_converged(state, cfg, len(prep.train), name or cfg.method)
    metrics = finish(model, prep, cfg, out, name or cfg.method)
    metrics.update({"train": {k: v for k, v in state.items() if k != "rng"},
                    "carbon_train": carbon_train.result(), "wall_seconds": time.perf_counter() - t0})
    write_json(out / "metrics.json", metrics)
    return metrics, model


def _warn_unless_converged(state: dict[str, Any], cfg: RunConfig, n_train: int, name: str) -> None:
    """The convergence signal on stderr: a warning when the loss was still falling (or the run too short)."""
    from condcomp.experiments.classification.convergence import warning

    epochs = state["step"] / max(1, math.ceil(n_train / cfg.batch_size))
    message = warning(state["convergence"], epochs, name)
    if message:
        print(message, file=sys.stderr, flush=True)


def finish(model: EncoderClassifier, prep: PreparedDataset, cfg: RunConfig, out: Path, name: str,
           timing: bool = True) -> dict[str, Any]:
    """Evaluate + measure a trained model; writes examples.json; returns the metrics dict (not yet written)."""
    with CarbonTracker(cfg.carbon_country, str(out)) as carbon_eval:
        ev = evaluate(model, prep.test, cfg.eval_batch_size, desc=f"{name} eval")
    write_json(out / "examples.json", {**ev["examples"], "tags": prep.test.tags,
                                       "overlap": prep.test.info.get("overlap")})
    timing_row = measure(model, prep.test, cfg.latency_reps) if timing else None
    row = summarize(model, ev, timing_row)
    return {"name": name, "method": cfg.method, "config": cfg.to_dict(), "model": model.config.to_dict(),
            "data": prep.notes, "environment": environment(), "carbon_eval": carbon_eval.result(), **row}


def eval_checkpoint(ckpt: Path, out: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rebuild the model a checkpoint was trained as, load it, evaluate and measure on the run's test split."""
    from condcomp.checkpoint import load_checkpoint, read_checkpoint_config

    meta = read_checkpoint_config(ckpt)
    if "run" not in meta or "model" not in meta:
        raise ValueError(f"{ckpt}: not a condcomp experiments checkpoint (its config has no 'run'/'model')")
    cfg = RunConfig.from_dict({**meta["run"], **(overrides or {})})
    tokenizer = None
    if cfg.tokenizer == "trained" and cfg.dataset not in ("synthetic", "digits"):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prep, _ = prepare(cfg, tokenizer)
    model = build_model(ModelConfig.from_dict(meta["model"]), cfg)
    load_checkpoint(ckpt, model)
    metrics = finish(model, prep, cfg, out, cfg.method)
    metrics["checkpoint"] = str(ckpt)
    write_json(out / "metrics.json", metrics)
    return metrics
