"""The DiT study: every variant at every seed, resumable, and one ``summary.json`` of records and statistics.

Runs go to ``OUT/seed<S>/<variant>/`` (``metrics.json`` is written last: a folder holding it is finished and is
skipped when the study is run again with the same settings; an unfinished one resumes from its ``checkpoint.pt``,
exactly as if never stopped). Seeds are the outer loop, so an interrupted study
leaves whole seeds. The ``fixed`` variant of a seed is trained at the nearest whole head count to that seed's
``budgetformer_cond`` measured mean heads (fixed top-k at matched heads), so it runs after it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from condcomp.experiments.dit.classifier import load_or_train_judge
from condcomp.experiments.dit.data import digits_images, npz_images
from condcomp.experiments.dit.frechet import frechet_distance
from condcomp.experiments.dit.train import DiTRunSettings, run_one
from condcomp.experiments.dit.variants import VARIANTS
from condcomp.experiments.stats import mean_ci

DEFAULT_VARIANTS = ("dense", "moh_90", "moh_75", "moh_50", "budgetformer_cond", "fixed")
METRICS = ("frechet", "class_accuracy", "heads", "flop_fraction", "sampling_seconds", "train_seconds")
MATCHED_TO = "budgetformer_cond"  # the learned arm whose mean heads the fixed arm matches


@dataclass
class StudyPaths:
    out: Path

    def run(self, seed: int, variant: str) -> Path:
        return self.out / f"seed{seed}" / variant

    @property
    def summary(self) -> Path:
        return self.out / "summary.json"

    @property
    def judge(self) -> Path:
        return self.out / "judge.pt"


def ordered(variants: list[str]) -> list[str]:
    """Variants in run order (``fixed`` after the learned arm it matches); unknown names are an error."""
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise KeyError(f"unknown DiT variants {bad}; valid: {list(VARIANTS)}")
    if "fixed" in variants and MATCHED_TO not in variants:
        raise ValueError(f"the fixed variant is matched to {MATCHED_TO}'s heads: run both (add {MATCHED_TO})")
    return sorted(dict.fromkeys(variants), key=lambda v: (v == "fixed", VARIANTS.index(v)))


def matched_fraction(learned: dict[str, Any], num_heads: int) -> float:
    """The nearest whole head count to the learned arm's measured mean, as a fraction of the heads."""
    return max(1, round(float(learned["heads"]) * num_heads)) / num_heads


def load_finished(path: Path, settings: DiTRunSettings) -> dict[str, Any] | None:
    """A finished run's metrics, or None; a run made with other settings is an error (mixing them is wrong)."""
    file = path / "metrics.json"
    if not file.is_file():
        return None
    try:
        record: dict[str, Any] = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err}); delete the folder to run it again") from None
    if record.get("settings") != settings.to_dict():
        raise ValueError(f"{file} was made with other settings ({record.get('settings')}); use another --out or "
                         "delete the folder")
    return record


def load_data(settings: DiTRunSettings, data_file: Path | None, device: str) -> dict[str, tuple[Tensor, Tensor]]:
    """The digits (default) or an ``.npz`` image set, checked against the model's shape, on ``device``."""
    mcfg = settings.model_config()
    data = digits_images(mcfg.image_size) if data_file is None else npz_images(data_file)
    images, labels = data["train"]
    want = (mcfg.channels, mcfg.image_size, mcfg.image_size)
    if tuple(images.shape[1:]) != want or tuple(data["test"][0].shape[1:]) != want:
        raise ValueError(f"the images are {tuple(images.shape[1:])} but the DiT preset {settings.preset!r} expects "
                         f"{want}; choose a preset (or --model overrides) of that shape")
    if int(labels.max()) >= mcfg.num_classes or int(labels.min()) < 0:
        raise ValueError(f"labels must lie in 0..{mcfg.num_classes - 1} (the model's num_classes); set "
                         '--model \'{"num_classes": N}\'')
    return {k: (x.to(device), y.to(device)) for k, (x, y) in data.items()}


def run_dit_study(out: Path, seeds: list[int], variants: list[str], settings: DiTRunSettings,
              command: str | None = None, data_file: Path | None = None, device: str = "cpu",
              checkpoint_every: int = 50) -> dict[str, Any]:
    """Run (or reuse) every variant at every seed and write ``OUT/summary.json``; returns the summary.

    ``data_file``: an ``.npz`` image set instead of the digits; ``device``: where training and sampling run;
    ``checkpoint_every``: steps between a run's checkpoints (an unfinished run resumes from its last, exactly)."""
    paths = StudyPaths(out)
    data = load_data(settings, data_file, device)
    judge, judge_facts = load_or_train_judge(paths.judge, data)
    with torch.no_grad():
        reference = frechet_distance(judge.features(data["train"][0][:10000]), judge.features(data["test"][0]))
    H = settings.model_config().num_heads
    for seed in seeds:
        done: dict[str, dict[str, Any]] = {}
        for variant in ordered(variants):
            fraction = matched_fraction(done[MATCHED_TO], H) if variant == "fixed" else None
            record = load_finished(paths.run(seed, variant), settings)
            if record is None:
                t0 = time.perf_counter()
                record = run_one(variant, seed, settings, data, judge, paths.run(seed, variant), fraction, device,
                                 checkpoint_every)
                print(f"seed {seed} {variant}: FD {record['frechet']:.3f}, class accuracy "
                      f"{record['class_accuracy']:.3f}, heads {record['heads']:.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            done[variant] = record
            # Every finished run under OUT, not only this process's: studies of different seeds may run side by
            # side into one folder, each rewriting the summary (atomically) with all of them.
            summary = summarise(finished_runs(out, settings), settings, judge_facts, reference, command)
            write_json(paths.summary, summary)
    return summarise(finished_runs(out, settings), settings, judge_facts, reference, command)


def finished_runs(out: Path, settings: DiTRunSettings) -> list[dict[str, Any]]:
    """Every finished run under ``out`` made with ``settings``, by seed then variant order."""
    records = []
    for file in out.glob("seed*/*/metrics.json"):
        record = load_finished(file.parent, settings)
        if record is not None:
            records.append(record)
    return sorted(records, key=lambda r: (r["seed"], VARIANTS.index(r["variant"])))


def summarise(records: list[dict[str, Any]], settings: DiTRunSettings, judge: dict[str, Any], reference: float,
              command: str | None) -> dict[str, Any]:
    """Slim records (no per-step detail), per-variant means with 95 % t-intervals over seeds, the noise-level
    profiles, and the paired learned-vs-fixed differences."""
    variants = list(dict.fromkeys(r["variant"] for r in records))
    stats = {v: {m: mean_ci([r[m] for r in records if r["variant"] == v]) for m in METRICS} for v in variants}
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_seed.setdefault(r["seed"], {})[r["variant"]] = r
    pairs = [(s[MATCHED_TO], s["fixed"]) for s in by_seed.values() if MATCHED_TO in s and "fixed" in s]
    paired = {m: mean_ci([a[m] - b[m] for a, b in pairs]) for m in ("frechet", "class_accuracy", "heads")}
    slim = [{k: v for k, v in r.items() if k not in ("per_step", "settings", "model")} for r in records]
    return {"command": command, "settings": settings.to_dict(), "model": settings.model_config().to_dict(),
            "judge": judge, "reference_frechet_train_vs_test": reference, "records": slim, "statistics": stats,
            "learned_minus_fixed": {"pairs": len(pairs), **paired}, "noise_profiles": noise_profiles(records)}


def noise_profiles(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per routed variant: the noise levels of the sampler's steps and, per step, the mean over seeds of the
    heads (k_frac) and budget (s) of each layer."""
    out: dict[str, dict[str, Any]] = {}
    for v in dict.fromkeys(r["variant"] for r in records):
        runs = [r["per_step"] for r in records if r["variant"] == v and r.get("per_step")]
        if not runs:
            continue
        layers = list(runs[0][0]["layers"])
        prof: dict[str, Any] = {"t": [st["t"] for st in runs[0]], "seeds": len(runs), "layers": {}}
        for name in layers:
            prof["layers"][name] = {key: [sum(run[i]["layers"][name][key] for run in runs) / len(runs)
                                          for i in range(len(runs[0]))] for key in ("k_frac", "s_mean")}
        out[v] = prof
    return out


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)
