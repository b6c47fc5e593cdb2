"""Markdown tables from metrics.json files (single runs, ablations, the demo) and ``condcomp report``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = (("accuracy", "acc", "{:.4f}"), ("s_mean", "s_mean", "{:.3f}"), ("k_frac", "heads %", "{:.1%}"),
           ("flop_frac", "FLOP frac", "{:.3f}"), ("latency_b1", "lat b1 ms", "ms"),
           ("latency_b64", "lat b64 ms", "ms"), ("speedup_b64", "speedup b64", "{:.2f}x"),
           ("peak_mem_b64", "peak MiB b64", "mib"), ("train_seconds", "train s", "{:.0f}"))


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "ms":
        return f"{1000 * value:.2f}"
    if spec == "mib":
        return f"{value / 2**20:.1f}"
    return spec.format(value)


def markdown_table(rows: dict[str, dict[str, Any]], columns: tuple[tuple[str, str, str], ...] = COLUMNS) -> str:
    """One line per row name; missing values print as ``-``."""
    cols = [c for c in columns if any(r.get(c[0]) is not None for r in rows.values())]
    lines = ["| run | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(r.get(key), spec) for key, _, spec in cols) + " |")
    return "\n".join(lines)


def rows_of(metrics: dict[str, Any], label: str) -> dict[str, dict[str, Any]]:
    """Rows of an ablation/demo metrics.json (``rows``) or one row for a single run."""
    if "rows" in metrics:
        prefix = f"{label}/" if label else ""
        return {f"{prefix}{k}": v for k, v in metrics["rows"].items()}
    row = dict(metrics)
    row["train_seconds"] = (metrics.get("train") or {}).get("seconds")
    return {f"{label}/{metrics.get('name', 'run')}": row}


def render_metrics_report(paths: list[Path], out: Path | None = None, plots: bool = True) -> str:
    """Markdown report of the metrics.json files (folders are searched for their top-level metrics.json)."""
    sections = ["# condcomp report", ""]
    all_rows: dict[str, dict[str, Any]] = {}
    for p in paths:
        file = p / "metrics.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"report: no metrics.json at {p}")
        try:
            metrics = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"report: {file} is not valid JSON ({err})") from None
        label = metrics.get("dataset") or file.parent.name
        rows = rows_of(metrics, label)
        all_rows.update(rows)
        note = (metrics.get("data") or {}).get("note")
        sections += [f"## {label}" + (f" ({note})" if note else ""), "", markdown_table(rows), ""]
        difficulty = metrics.get("difficulty")
        if difficulty:
            sections += ["Budget by difficulty (BudgetFormer):", "", markdown_table(difficulty), ""]
        if (file.parent / "budgetformer" / "examples.json").is_file():
            from condcomp.experiments.classification.analysis import budget_by_proxy

            for proxy, res in budget_by_proxy(file.parent).items():
                corr = f", Pearson r(proxy, s) = {res['pearson_s']:.3f}" if "pearson_s" in res else ""
                sections += [f"BudgetFormer's budget by {proxy}{corr}:", "", markdown_table(res["rows"]), ""]
    text = "\n".join(sections)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(text)
        if plots:
            from condcomp.experiments.classification.plots import plot_accuracy_vs_heads

            plot_accuracy_vs_heads(all_rows, out / "accuracy_vs_heads.png")
    return text
