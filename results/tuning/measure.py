"""docs/tuning.md's "Measured" table: BudgetFormer's training options on the synthetic task of tests/test_training.py.

One HeadAttention layer (D = 32, H = 8) + classifier, 200 Adam steps (lr 1e-2, batch 48), s in [0.25, 0.75],
accuracy on 1000 held-out examples, one thread, seeds 1-3 (seed 0 is the test's own), the masked executor as in
the test. Writes ``table.json`` beside this file and prints the markdown table. About a minute of one CPU core:

    python results/tuning/measure.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import condcomp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_training import S_MAX, S_MIN, train  # noqa: E402

SEEDS = (1, 2, 3)
ROWS = {  # label -> (policy options beyond the interval, router options); None: the unwrapped model
    "full budget (unwrapped)": None,
    "budgetformer + topk, defaults (`budget_weight=10`)": ({}, {}),
    "same, `budget_weight=10`, `mask_temperature=0.5`": ({}, {"mask_temperature": 0.5}),
    "`budget_weight=1` (straight-through)": ({"budget_weight": 1.0}, {}),
    "`budget_weight=1`, `mask_temperature=1.0`": ({"budget_weight": 1.0}, {"mask_temperature": 1.0}),
    "`budget_weight=1`, `noise_std=0`": ({"budget_weight": 1.0}, {"noise_std": 0.0}),
    "`budget_weight=1`, `gates=\"renormalized\"`": ({"budget_weight": 1.0}, {"gates": "renormalized"}),
    "`budget_weight=1`, `train_mode=\"soft_topk\"`, `mask_temperature=1.0`":
        ({"budget_weight": 1.0}, {"train_mode": "soft_topk", "mask_temperature": 1.0}),
}


def run() -> dict[str, dict]:
    torch.set_num_threads(1)
    out = {}
    for label, options in ROWS.items():
        accs, s_per_seed = [], []
        for seed in SEEDS:
            cfg = None if options is None else condcomp.CondCompConfig(
                policy=("budgetformer", {"s_min": S_MIN, "s_max": S_MAX, **options[0]}),
                router=("topk", options[1]), executor="masked")
            acc, net = train(cfg, seed=seed)
            accs.append(acc)
            if cfg is not None:
                s = condcomp.routed_modules(net)["attn"].last.s  # (1000,) the held-out batch
                s_per_seed.append([float(s.mean()), float(s.min()), float(s.max())])
        out[label] = {"options": options, "seeds": list(SEEDS), "accuracy": accs,
                      "s_mean_min_max_per_seed": s_per_seed or None}
    return out


def test_seed() -> dict:
    """What tests/test_training.py's own run (seed 0) measures: full and routed accuracy, s range, head sets."""
    full, _ = train(None, seed=0)
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {"s_min": S_MIN, "s_max": S_MAX}), router="topk",
                                  executor="masked")
    acc, net = train(cfg, seed=0)
    last = condcomp.routed_modules(net)["attn"].last
    return {"seed": 0, "full": full, "budgetformer": acc, "s_min": float(last.s.min()),
            "s_max": float(last.s.max()), "head_sets": len({tuple(r.tolist()) for r in last.plan.active})}


def table(rows: dict[str, dict]) -> str:
    lines = ["| configuration | accuracy per seed | mean | s (mean, min, max) of the last seed |", "|---|---|---|---|"]
    for label, r in rows.items():
        s = (r["s_mean_min_max_per_seed"] or [None])[-1]
        lines.append(f"| {label} | {' / '.join(f'{a:.3f}' for a in r['accuracy'])} | "
                     f"{sum(r['accuracy']) / len(r['accuracy']):.3f} | "
                     + (", ".join(f"{v:.2f}" for v in s) if s else "-") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    rows = run()
    record = {"command": "python results/tuning/measure.py", "torch": torch.__version__, "rows": rows,
              "test_seed": test_seed()}
    (Path(__file__).parent / "table.json").write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows))
