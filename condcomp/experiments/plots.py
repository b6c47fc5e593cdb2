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


def _arm_family(arm: str) -> str:
    if arm in ("standard",) or arm.startswith("fixed_"):
        return "fixed top-k (standard = all heads)"
    if arm.startswith("budgetformer_cost") or arm == "budgetformer":
        return "BudgetFormer"
    if arm.startswith("moh"):
        return "MoH"
    return "control"


def plot_pareto(records: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Accuracy against realised heads (k/H) per arm of one dataset: the mean over seeds with its 95 % interval
    (error bar) and every seed (small dots); fixed top-k arms joined by a line (the fixed-budget frontier)."""
    plt = _pyplot()
    if plt is None:
        return False
    from condcomp.experiments.stats import mean_ci

    arms = sorted({r["arm"] for r in records if r.get("accuracy") is not None and r.get("heads") is not None})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {"fixed top-k (standard = all heads)": ("tab:grey", "s"), "BudgetFormer": ("tab:blue", "o"),
              "MoH": ("tab:orange", "^"), "control": ("tab:red", "x")}
    fixed_pts = []
    seen: set[str] = set()
    for arm in arms:
        rs = [r for r in records if r["arm"] == arm]
        if arm == "fixed_1" and any(r["arm"] == "standard" for r in records):
            continue  # the same runs as "standard"
        dirs = {r.get("run_dir") for r in rs}
        if arm == "fixed_matched" and dirs <= {r.get("run_dir") for r in records if r["arm"].startswith("fixed_0")}:
            continue  # every matched run is also a sweep arm's run (the same folder): drawn once
        fam = _arm_family(arm)
        color, marker = styles[fam]
        acc = mean_ci([r["accuracy"] for r in rs])
        heads = mean_ci([r["heads"] for r in rs])["mean"]
        ax.scatter([r["heads"] for r in rs], [r["accuracy"] for r in rs], color=color, s=8, alpha=0.35)
        err = None if acc["lo"] is None else [[acc["mean"] - acc["lo"]], [acc["hi"] - acc["mean"]]]
        ax.errorbar([heads], [acc["mean"]], yerr=err, color=color, marker=marker, ms=6, capsize=3, ls="",
                    label=fam if fam not in seen else None)
        seen.add(fam)
        ax.annotate(f"{arm} (n={len(rs)})", (heads, acc["mean"]), fontsize=6, xytext=(4, 3),
                    textcoords="offset points")
        if fam.startswith("fixed"):
            fixed_pts.append((heads, acc["mean"]))
    if len(fixed_pts) > 1:
        fixed_pts.sort()
        ax.plot([p[0] for p in fixed_pts], [p[1] for p in fixed_pts], color="tab:grey", lw=1, alpha=0.7)
    ax.set_xlabel("realised heads (k/H, mean over test examples / tokens)")
    ax.set_ylabel("test accuracy")
    ax.set_xlim(0, 1.05)
    ax.set_title(title or "accuracy vs heads", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return _save(plt, fig, path)


def plot_head_heatmaps(freqs: dict[str, list[list[float]]], path: Path, title: str = "") -> bool:
    """One layer x head heatmap per arm: how often each head ran (mean over test examples, or tokens for MoH)."""
    plt = _pyplot()
    if plt is None or not freqs:
        return False
    n = len(freqs)
    fig, axes = plt.subplots(1, n, figsize=(2.2 + 2.6 * n, 3.0), squeeze=False, constrained_layout=True)
    im = None
    for ax, (arm, grid) in zip(axes[0], freqs.items()):
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(arm, fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.set_xticks(range(len(grid[0])))
        ax.set_yticks(range(len(grid)))
        ax.tick_params(labelsize=6)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5,
                        color="white" if v < 0.5 else "black")
    fig.suptitle(title or "head selection frequency", fontsize=9)
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_difficulty(series: dict[str, list[dict[str, float]]], path: Path, title: str = "") -> bool:
    """Mean predicted budget s per equal-count bin (decile) of a difficulty proxy, one line per (proxy, seed);
    the legend gives each line's mean proxy value in the first and last bin."""
    plt = _pyplot()
    if plt is None or not series:
        return False
    proxies = sorted({k.split("/")[0] for k in series})
    fig, axes = plt.subplots(1, len(proxies), figsize=(4.2 * len(proxies), 3.2), squeeze=False)
    for ax, proxy in zip(axes[0], proxies):
        for key, bins in series.items():
            if key.split("/")[0] != proxy:
                continue
            ax.plot(range(1, len(bins) + 1), [b["y_mean"] for b in bins], marker="o", ms=3, lw=1,
                    label=f"{key.split('/', 1)[1]} ({proxy} {bins[0]['x_mean']:.3g} .. {bins[-1]['x_mean']:.3g})")
        ax.set_xlabel({"loss": "decile of the standard model's loss (1 = easiest, 10 = hardest)",
                       "length": "decile of the length in tokens (1 = shortest)"}.get(proxy, proxy), fontsize=8)
        ax.set_xticks(range(1, 11))
        ax.set_ylabel("predicted budget s (mean per bin)", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(title or "budget vs difficulty", fontsize=9)
    return _save(plt, fig, path)
