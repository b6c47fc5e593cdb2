"""Collect the budget-search runs (run_search.sh) into results/budget_search/search.json and print a table.

Every folder needs its own standard run. Per run: its settings (the exact train command's options), accuracy,
s_mean, the adaptivity measures (condcomp.experiments.classification.adaptivity) with the folder's standard run
as the difficulty proxy and the accuracy reference.

    python results/budget_search/collect.py [runs/search [runs/search_dbpedia ...]]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from condcomp.experiments.classification.adaptivity import adaptivity


def collect(out: Path, prefix: str = "") -> tuple[dict[str, Any], float | None]:
    """The runs of one folder (difficulty and accuracy reference: its standard run), names prefixed."""
    std_file = out / "standard" / "examples.json"
    loss = json.loads(std_file.read_text())["loss"] if std_file.is_file() else None
    std_acc = json.loads((out / "standard" / "metrics.json").read_text())["accuracy"] if loss else None
    rows = {}
    for d in sorted(p for p in out.iterdir() if (p / "metrics.json").is_file()):
        m = json.loads((d / "metrics.json").read_text())
        ex = json.loads((d / "examples.json").read_text())
        cfg = m["config"]
        a = adaptivity(ex, m["model"]["num_heads"], loss) if m["method"] != "standard" else None
        rows[prefix + d.name] = {
            "method": m["method"], "method_options": cfg["method_options"], "budget_cost": cfg["budget_cost"],
            "budget_target": cfg.get("budget_target", 0.0),
            "dataset": cfg["dataset"], "preset": cfg["preset"], "seed": cfg["seed"], "max_len": cfg["max_len"],
            "steps": m["train"]["step"], "n_test": m["n"], "standard_accuracy": std_acc,
            "accuracy": m["accuracy"], "s_mean": m["s_mean"], "heads": m["k_frac"],
            "layers_heads": {n: v["k_frac"] for n, v in m["layers"].items()},
            "adaptivity": a,
        }
    # accuracy reference: a standard run of the same model and steps in this folder (medium_standard for
    # medium_explore), else the folder's standard; the difficulty proxy stays the folder's standard
    same = {(r["preset"], r["steps"]): r["accuracy"] for r in rows.values() if r["method"] == "standard"}
    for r in rows.values():
        r["standard_accuracy"] = same.get((r["preset"], r["steps"]), std_acc)
    return rows, std_acc


def main(outs: list[Path]) -> int:
    dest = Path(__file__).with_name("search.json")
    # runs recorded before whose folders are gone stay (--threads 1 runs repeat exactly, so a rerun standard
    # is the same difficulty proxy); a run collected now replaces its old record
    old = json.loads(dest.read_text()) if dest.is_file() else {"runs": {}}
    rows: dict[str, Any] = old["runs"]
    for r in rows.values():  # records from before the per-run fields: AG News, seed 0, the search's defaults
        r.setdefault("seed", 0)
        r.setdefault("max_len", old.get("max_len"))
        r.setdefault("standard_accuracy", old.get("standard_accuracy"))
    std_acc = None
    for i, out in enumerate(outs):
        # the first folder's runs keep their names; a further folder's are prefixed with its dataset
        cfg = json.loads((out / "standard" / "metrics.json").read_text())["config"] if i else {}
        got, acc = collect(out, f"{cfg.get('dataset', out.name)}/" if i else "")
        rows.update(got)
        std_acc = acc if i == 0 else std_acc
    # every run's accuracy reference: a standard run of its dataset, model, steps and length when one was trained
    # (standard_598 for the 598-step runs, collected or kept from before), else the one its folder gave it
    same = {(r.get("dataset"), r.get("preset"), r.get("steps"), r.get("max_len")): r["accuracy"]
            for r in rows.values() if r.get("method") == "standard"}
    for r in rows.values():
        if r.get("method") != "standard":
            key = (r.get("dataset"), r.get("preset"), r.get("steps"), r.get("max_len"))
            r["standard_accuracy"] = same.get(key, r.get("standard_accuracy"))
    out = outs[0]
    first = rows.get("standard", {})  # the first folder's standard: the defaults of the search
    cfg0 = json.loads((out / "standard" / "metrics.json").read_text())["config"] if std_acc is not None else {}
    result = {"standard_accuracy": std_acc, "steps": first.get("steps"), "n_test": first.get("n_test"),
              "max_len": cfg0.get("max_len"), "runs": rows}
    result["gradients"] = {f.stem[len("gradients_"):]: json.loads(f.read_text())
                           for f in sorted(Path(__file__).parent.glob("gradients_*.json"))}
    dest.write_text(json.dumps(result, indent=1, sort_keys=True))
    print("| run | acc | acc - std (pts) | s_mean | s sd | k off mode (any layer) | per layer k (off mode) | "
          "Spearman(difficulty, s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        a = r["adaptivity"]
        ref = r["standard_accuracy"]
        gap = f"{100 * (r['accuracy'] - ref):+.2f}" if ref is not None else "-"
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
    raise SystemExit(main([Path(a) for a in sys.argv[1:]] or [Path("runs/search")]))
