"""PNG plots (matplotlib, imported lazily; ``pip install 'condcomp[report]'``). Missing matplotlib: a warning."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'condcomp[report]')", file=sys.stderr)
        return None
    return plt


def _save(plt: Any, fig: Any, path: Path) -> bool:
    """Lay out, write the PNG and free the figure (pyplot keeps every open figure alive otherwise)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_budget_by_difficulty(s: list[float], groups: list[str], path: Path, title: str = "") -> bool:
    """Histogram of the predicted budget s per difficulty group."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    lo, hi = min(s), max(s)
    pad = max(0.02, 0.1 * (hi - lo))  # zoom on the data: budgets often sit in a narrow band
    for g in sorted(set(groups)):
        vals = [v for v, t in zip(s, groups) if t == g]
        ax.hist(vals, bins=40, range=(max(0.0, lo - pad), min(1.0, hi + pad)), alpha=0.6,
                label=f"{g} (n={len(vals)}, mean {sum(vals) / len(vals):.3f})")
    ax.set_xlabel("predicted budget s (mean over layers)")
    ax.set_ylabel("examples")
    ax.set_title(title or "budget by difficulty", fontsize=9)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_layer_usage(rows: dict[str, dict[str, Any]], path: Path) -> bool:
    """Realised head fraction per layer, one group of bars per run."""
    plt = _pyplot()
    if plt is None:
        return False
    runs = [n for n, r in rows.items() if r.get("layers")]
    layers = sorted({ly for n in runs for ly in rows[n]["layers"]})
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / max(1, len(runs))
    for i, n in enumerate(runs):
        vals = [rows[n]["layers"].get(ly, {}).get("k_frac", 0.0) for ly in layers]
        ax.bar([j + i * width for j in range(len(layers))], vals, width, label=n)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))], [ly.split(".attn")[0] for ly in layers])
    ax.set_ylabel("realised heads (k/H)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_accuracy_vs_heads(rows: dict[str, dict[str, Any]], path: Path) -> bool:
    """Accuracy against realised head fraction: colour = arm, marker = dataset (row names ``dataset/arm``)."""
    plt = _pyplot()
    if plt is None:
        return False
    points = [(n.rpartition("/")[0], n.rpartition("/")[2], r) for n, r in rows.items()
              if r.get("accuracy") is not None and r.get("k_frac") is not None]
    arms = sorted({a for _, a, _ in points})
    groups = sorted({g for g, _, _ in points})
    colors = {a: plt.cm.tab20(i % 20) for i, a in enumerate(arms)}
    markers = {g: "os^Dv<>pPX*h"[i % 12] for i, g in enumerate(groups)}
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for g, a, r in points:
        ax.scatter(r["k_frac"], r["accuracy"], color=colors[a], marker=markers[g], s=28)
    handles = [plt.Line2D([], [], color=colors[a], marker="o", ls="", label=a) for a in arms]
    handles += [plt.Line2D([], [], color="grey", marker=markers[g], ls="", label=g or "run") for g in groups]
    ax.legend(handles=handles, fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_xlabel("realised heads (k/H)")
    ax.set_ylabel("accuracy")
    return _save(plt, fig, path)
