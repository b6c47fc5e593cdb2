"""``condcomp demo``: the standard Transformer, BudgetFormer, fixed top-k at BudgetFormer's realised mean head
count, and MoH on the embedded synthetic task (docs/demo.md); one table, the difficulty verdict, plots."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from condcomp.experiments.classification.metrics_report import COLUMNS, markdown_table
from condcomp.experiments.classification.plots import plot_budget_by_difficulty, plot_layer_usage
from condcomp.experiments.classification.runconfig import RunConfig
from condcomp.experiments.classification.runner import write_json
from condcomp.experiments.classification.seed_study import SeedStudy, collect, matched_fraction

# 2 layers x 8 heads, d = 64, 24 tokens: big enough for heads to matter, small enough for ~90 s on 2 CPU cores.
DEMO: dict[str, Any] = {
    "dataset": "synthetic", "preset": "small", "d_model": 64, "num_layers": 2, "num_heads": 8, "d_ff": 128,
    "max_len": 24, "synthetic_len": 24, "synthetic_train": 4000, "synthetic_test": 1000, "epochs": 3,
    "batch_size": 64, "lr": 3e-3, "dropout": 0.0, "eval_batch_size": 250, "latency_reps": 15,
    "method_options": {"s_min": 0.1, "s_max": 0.9}, "budget_cost": 0.1,
}
# the table's columns, then PlateauCheck's verdict on each arm's training loss (convergence.py)
DEMO_COLUMNS = (*COLUMNS, ("loss_flat", "loss flat", "{}"))
QUICK: dict[str, Any] = {"d_model": 32, "num_heads": 4, "d_ff": 64, "num_layers": 1, "synthetic_train": 256,
                         "synthetic_test": 128, "epochs": 1, "latency_reps": 2}


def demo_config(seed: int = 0, quick: bool = False, **overrides: Any) -> RunConfig:
    """The demo's run configuration (``quick``: a seconds-long smoke version)."""
    return RunConfig.from_dict({**DEMO, **(QUICK if quick else {}), "seed": seed, **overrides})


def run_demo(out: Path, seed: int = 0, quick: bool = False, **overrides: Any) -> dict[str, Any]:
    """Train the four methods, print the table and verdict, write metrics.json and PNG plots into ``out``."""
    t0 = time.perf_counter()
    cfg = demo_config(seed, quick, **overrides)
    study = SeedStudy(cfg, out, reuse=False)
    study.train("standard", "standard")
    bf = study.train("budgetformer", "budgetformer", cfg.method_options)
    H = int(bf["model"]["num_heads"])
    matched = matched_fraction(bf["k_frac"], H)
    study.train("fixed_topk", "fixed", {"fraction": matched})
    study.train("moh", "moh", None)
    study.paired_timing(cfg.latency_reps)
    result = collect(study, matched)
    for name, row in result["rows"].items():
        row["convergence"] = (study.rows[name].get("train") or {}).get("convergence")
        row["loss_flat"] = loss_flat(row["convergence"])
    by_tag = bf.get("by_tag") or {}
    result["difficulty"] = by_tag
    easy, hard = by_tag.get("easy", {}), by_tag.get("hard", {})
    result["hard_more_heads"] = bool(hard and easy and hard["k_frac"] > easy["k_frac"])
    result["wall_seconds"] = time.perf_counter() - t0
    examples = json.loads((out / "budgetformer" / "examples.json").read_text())
    plots = []
    if plot_budget_by_difficulty(examples["s"], examples["tags"], out / "budget_by_difficulty.png",
                                 "BudgetFormer: predicted budget s, easy vs hard examples"):
        plots.append("budget_by_difficulty.png")
    if plot_layer_usage(result["rows"], out / "layer_usage.png"):
        plots.append("layer_usage.png")
    result["plots"] = plots
    write_json(out / "metrics.json", result)
    print(markdown_table(result["rows"], DEMO_COLUMNS))
    note = not_converged_note(result["rows"])
    if note:
        print(f"\n{note}")
    print(f"\nfixed_topk runs {round(matched * H)} of {H} heads: BudgetFormer's realised mean "
          f"{bf['k_frac'] * H:.2f} heads, rounded up. Latency: median, executor '{bf.get('executor')}'.")
    if easy and hard:
        verdict = "YES" if result["hard_more_heads"] else "NO"
        print(f"Hard examples received more heads than easy ones: {verdict} (BudgetFormer: hard "
              f"{hard['k_frac']:.1%} heads, s={hard['s_mean']:.3f}, acc {hard['accuracy']:.3f}; easy "
              f"{easy['k_frac']:.1%} heads, s={easy['s_mean']:.3f}, acc {easy['accuracy']:.3f})")
    print(f"wrote {out / 'metrics.json'} and {', '.join(plots) or 'no plots'}; {result['wall_seconds']:.0f} s")
    return result


def loss_flat(convergence: dict[str, Any] | None) -> str:
    """The table's word for PlateauCheck's verdict: yes (the loss stopped falling), no, or "too short"."""
    if convergence is None:
        return "not recorded"
    plateaued = convergence.get("plateaued")
    return "too short" if plateaued is None else ("yes" if plateaued else "no")


def not_converged_note(rows: dict[str, dict[str, Any]]) -> str | None:
    """The line under the table naming the arms whose loss was still falling (or too short to tell), and what
    that means for a reader of the demo, whose length is fixed; None when every arm's loss was flat."""
    parts = []
    for name, row in rows.items():
        c = row.get("convergence") or {}
        if row.get("loss_flat") == "no":
            parts.append(f"{name} (still falling: {c['earlier_loss']:.3f} -> {c['last_loss']:.3f})")
        elif row.get("loss_flat") == "too short":
            parts.append(f"{name} ({c['steps']} steps, too few to tell)")
    if not parts:
        return None
    return ("Training loss not flat at the end (mean over the last fifth of the steps against the fifth before): "
            + ", ".join(parts) + ". Those arms' accuracy and budget are not final (the warnings on stderr say the "
            "same); the demo's length is fixed: docs/demo.md, 'Loss flat', says what to run instead.")
