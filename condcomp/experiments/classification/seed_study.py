"""The building block of an ablation on one dataset and seed: :class:`SeedStudy` trains arms (reusing finished
ones), evaluates inference-time controls on a trained model, and re-times the arms round-robin.

The multi-seed study (``condcomp ablate``) is :mod:`condcomp.experiments.classification.ablation`. A finished run (its
``metrics.json`` and checkpoint present, same settings) is reused, so an interrupted study restarts where it
stopped.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from condcomp.experiments.classification.batches import on_device
from condcomp.experiments.classification.methods import swapped
from condcomp.experiments.classification.metrics import inference_executor, restore_executor, set_executor
from condcomp.experiments.classification.model import EncoderClassifier, ModelConfig
from condcomp.experiments.classification.runconfig import PreparedDataset, RunConfig, changed_settings, prepare
from condcomp.experiments.classification.runner import finish, run_single, write_json
from condcomp.experiments.classification.train import build_model


class SeedStudy:
    """Runs methods on one prepared dataset under ``out/<name>/`` and collects their metrics rows."""

    def __init__(self, cfg: RunConfig, out: Path, prep: PreparedDataset | None = None, tokenizer: Any = None,
                 reuse: bool = True) -> None:
        self.cfg, self.out, self.reuse = cfg, out, reuse
        t0 = time.perf_counter()
        self.prep, self.tokenizer = (prep, tokenizer) if prep is not None else prepare(cfg)
        self.prepare_seconds = time.perf_counter() - t0
        self.rows: dict[str, dict[str, Any]] = {}
        self.models: dict[str, EncoderClassifier] = {}
        self.swaps: dict[str, tuple[str, dict[str, Any]]] = {}
        self.reused: dict[str, bool] = {}

    def train(self, name: str, method: str, options: dict[str, Any] | None = None,
              keep: bool = True, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Train ``method`` as run ``name`` (or reuse its finished metrics and checkpoint); ``overrides``: other
        run settings of this arm (e.g. ``{"budget_cost": 0.3}``)."""
        settings = {**self.cfg.to_dict(), **(overrides or {}), "method": method, "method_options": options or {}}
        if method != "budgetformer":
            settings["budget_target"] = 0.0  # the difficulty target trains a learned budget; this arm has none
        cfg = RunConfig.from_dict(settings)
        d = self.out / name
        self.reused[name] = False
        if self.reuse and (d / "metrics.json").is_file() and (d / "checkpoint" / "condcomp.json").is_file():
            self.reused[name] = True
            row = json.loads((d / "metrics.json").read_text())
            changed = changed_settings(row.get("config") or {}, cfg)
            if changed:
                raise ValueError(f"{d} holds a finished run with different settings ({', '.join(changed)}); "
                                 "use another --out or delete that folder to retrain")
            if keep:
                from condcomp.checkpoint import load_checkpoint

                model = build_model(ModelConfig.from_dict(row["model"]), cfg)
                load_checkpoint(d / "checkpoint", model)
                self.models[name] = model.eval()
        else:
            resume = self.reuse and (d / "checkpoint" / "condcomp.json").is_file()
            row, model = run_single(cfg, d, resume=resume, prep=self.prep, tokenizer=self.tokenizer, name=name)
            if keep:
                self.models[name] = model
        self.rows[name] = row
        return row

    def control(self, name: str, base: str, policy: str | None = None, fraction: float = 0.5,
                router: str | None = None, budgets: dict[str, list[float]] | None = None) -> dict[str, Any]:
        """Evaluate trained model ``base`` with its policy and/or router swapped (see ``methods.swapped``)."""
        model = self.models[base]
        d = self.out / name
        cfg = RunConfig.from_dict({**self.rows[base]["config"]})
        swap: dict[str, Any] = {"policy": policy, "fraction": fraction, "router": router}
        if budgets is not None:
            swap["budgets"] = budgets
        self.swaps[name] = (base, swap)
        if self.reuse and (d / "metrics.json").is_file() and self.reused.get(base):
            row = json.loads((d / "metrics.json").read_text())
            if row.get("swap") == [base, self.swaps[name][1]] and row.get("config") == cfg.to_dict():
                self.rows[name], self.reused[name] = row, True
                return row
        self.reused[name] = False
        with swapped(model, **swap):
            row = finish(model, self.prep, cfg, d, name)
        row.update({"control_of": base, "swap": self.swaps[name]})
        write_json(d / "metrics.json", row)
        self.rows[name] = row
        return row


    def paired_timing(self, reps: int) -> None:
        """Re-time every arm round-robin (one call each per round) so that all arms see the same machine load;
        medians replace the per-run latencies (a shared machine's load drifts over minutes)."""
        arms = [n for n in self.rows if n in self.models or n in self.swaps]
        for bs in (1, 64):
            batch = next(self.prep.test.batches(min(bs, len(self.prep.test))))
            ids, mask, seg, _ = on_device(batch, torch.device(self.cfg.device))
            times: dict[str, list[float]] = {n: [] for n in arms}
            with torch.no_grad():
                for rep in range(reps + 2):
                    for n in arms:
                        base, swap = self.swaps.get(n, (n, {}))
                        model = self.models[base]
                        previous = set_executor(model, inference_executor())
                        with swapped(model, **swap):
                            t0 = time.perf_counter()
                            model(ids, mask, seg)
                            dt = time.perf_counter() - t0
                        restore_executor(model, previous)
                        if rep >= 2:  # two warm-up rounds
                            times[n].append(dt)
            for n in arms:
                self.rows[n][f"latency_b{bs}"] = statistics.median(times[n])
                self.rows[n]["latency_paired"] = True


def matched_fraction(k_frac: float, num_heads: int, rounding: str = "ceil") -> float:
    """The fixed fraction matched to a realised mean head count ``k_frac * num_heads``.

    ``"ceil"``: the smallest count >= the mean (fixed top-k never gets fewer heads than the learned budget used
    on average; the demo's rule). ``"nearest"``: the closest count (halves up; the study's rule: with a mean of
    5.04 heads ceil would give fixed top-k a whole head more).
    """
    x = k_frac * num_heads
    if rounding == "ceil":
        k = math.ceil(x - 1e-6)
    elif rounding == "nearest":
        k = math.floor(x + 0.5)
    else:
        raise ValueError(f"rounding must be 'ceil' or 'nearest', got {rounding!r}")
    return max(1, min(num_heads, k)) / num_heads


def collect(study: SeedStudy, matched: float) -> dict[str, Any]:
    """The ablation summary: one row per arm (speedups vs standard), the matched fraction, data notes."""
    std = study.rows["standard"]
    rows = {}
    for name, r in study.rows.items():
        rows[name] = {k: r.get(k) for k in ("accuracy", "s_mean", "k_frac", "flop_frac", "latency_b1", "latency_b64",
                                            "peak_mem_b64", "executor", "by_tag", "layers", "wall_seconds",
                                            "control_of", "latency_paired", "flops")}
        rows[name]["train_seconds"] = (r.get("train") or {}).get("seconds")
        for bs in (1, 64):
            a, b = std.get(f"latency_b{bs}"), r.get(f"latency_b{bs}")
            rows[name][f"speedup_b{bs}"] = a / b if a and b else None
    return {"kind": "ablation", "dataset": study.cfg.dataset, "data": study.prep.notes, "matched_fraction": matched,
            "config": study.cfg.to_dict(), "model": std["model"], "environment": std["environment"],
            "prepare_seconds": study.prepare_seconds, "rows": rows}
