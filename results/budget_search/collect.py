"""Collect the budget-search runs (run_search.sh) into results/budget_search/search.json and print a table.

Per run: its settings (the exact train command's options), accuracy, s_mean, the adaptivity measures
(condcomp.experiments.classification.adaptivity) with the standard run of the same settings as the difficulty proxy.

    python results/budget_search/collect.py [runs/search]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from condcomp.experiments.classification.adaptivity import adaptivity


def main(out: Path) -> int:
    std_file = out / "standard" / "examples.json"
    loss = json.loads(std_file.read_text())["loss"] if std_file.is_file() else None
    std_acc = json.loads((out / "standard" / "metrics.json").read_text())["accuracy"] if loss else None
    rows = {}
    for d in sorted(p for p in out.iterdir() if (p / "metrics.json").is_file()):
        m = json.loads((d / "metrics.json").read_text())
        ex = json.loads((d / "examples.json").read_text())
        cfg = m["config"]
        a = adaptivity(ex, m["model"]["num_heads"], loss) if m["method"] != "standard" else None
        rows[d.name] = {
            "method": m["method"], "method_options": cfg["method_options"], "budget_cost": cfg["budget_cost"],
            "dataset": cfg["dataset"], "preset": cfg["preset"], "steps": m["train"]["step"], "n_test": m["n"],
            "accuracy": m["accuracy"], "s_mean": m["s_mean"], "heads": m["k_frac"],
            "layers_heads": {n: v["k_frac"] for n, v in m["layers"].items()},
            "adaptivity": a,
        }
    first = next(iter(rows.values()), {})
    cfg0 = json.loads((out / "standard" / "metrics.json").read_text())["config"] if std_acc is not None else {}
    result = {"standard_accuracy": std_acc, "steps": first.get("steps"), "n_test": first.get("n_test"),
              "max_len": cfg0.get("max_len"), "runs": rows}
    result["gradients"] = {f.stem[len("gradients_"):]: json.loads(f.read_text())
                           for f in sorted(Path(__file__).parent.glob("gradients_*.json"))}
    dest = Path(__file__).with_name("search.json")
    dest.write_text(json.dumps(result, indent=1, sort_keys=True))
    print("| run | acc | acc - std (pts) | s_mean | s sd | k off mode (any layer) | per layer k (off mode) | "
          "Spearman(difficulty, s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        a = r["adaptivity"]
        gap = f"{100 * (r['accuracy'] - std_acc):+.2f}" if std_acc is not None else "-"
        if a is None:
            print(f"| {name} | {r['accuracy']:.4f} | {gap} | - | - | - | - | - |")
            continue
        layers = "; ".join(f"{v['k_mean']:.2f} ({100 * v['k_off_mode']:.1f} %)" for _, v in sorted(a["layers"].items()))
        rho = a.get("spearman_difficulty_s")
        print(f"| {name} | {r['accuracy']:.4f} | {gap} | {r['s_mean']:.3f} | {a['s_sd']:.3f} | "
              f"{100 * a['k_off_mode_any']:.1f} % | {layers} | " + (f"{rho:+.3f}" if rho is not None else "-") + " |")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/search")))
