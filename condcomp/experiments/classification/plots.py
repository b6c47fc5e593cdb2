"""The classification study's plots: the demo's and the study page's figures (matplotlib, lazily;
``condcomp[report]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from condcomp.experiments.classification.ablation_stats import is_user_arm
from condcomp.experiments.plots import pyplot, save_figure


def plot_budget_by_difficulty(s: list[float], groups: list[str], path: Path, title: str = "") -> bool:
    """Histogram of the predicted budget s per difficulty group."""
    plt = pyplot()
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
    return save_figure(plt, fig, path)


def plot_layer_usage(rows: dict[str, dict[str, Any]], path: Path) -> bool:
    """Realised head fraction per layer, one group of bars per run."""
    plt = pyplot()
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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(plt, fig, path)


def plot_accuracy_vs_heads(rows: dict[str, dict[str, Any]], path: Path) -> bool:
    """Accuracy against realised head fraction: colour = arm, marker = dataset (row names ``dataset/arm``)."""
    plt = pyplot()
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
    return save_figure(plt, fig, path)


def _arm_family(arm: str) -> str:
    if arm == "standard" or (arm.startswith("fixed_") and arm[6:].replace(".", "", 1).isdigit()):
        return "fixed top-k sweep (standard = all heads)"
    if arm in ("fixed_matched", "fixed_per_layer"):
        return "fixed top-k, matched / per-layer counts"
    if arm.startswith("budgetformer_cost") or arm == "budgetformer":
        return "BudgetFormer"
    if arm.startswith("moh"):
        return "MoH"
    if is_user_arm(arm):
        return "your router / policy"
    return "control"


_STYLES = {"fixed top-k sweep (standard = all heads)": ("tab:grey", "s"),
           "fixed top-k, matched / per-layer counts": ("dimgrey", "D"), "BudgetFormer": ("tab:blue", "o"),
           "MoH": ("tab:orange", "^"), "your router / policy": ("tab:green", "P"), "control": ("tab:red", "x")}


def plot_pareto(records: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Accuracy against realised heads (k/H; left) and analytic FLOP fraction (right) per arm of one dataset: the
    mean over seeds with its 95 % t-interval (one seed: the binomial interval of its test accuracy, dashed) and
    every seed (small dots); the fixed top-k sweep joined by a line (the fixed-budget frontier)."""
    plt = pyplot()
    if plt is None:
        return False
    import math

    from condcomp.experiments.stats import mean_ci

    arms = sorted({r["arm"] for r in records if r.get("accuracy") is not None and r.get("heads") is not None})
    # one colour per arm (the legend, outside the axes, names them: no labels on the data to overlap), one marker
    # per family
    palette = plt.get_cmap("tab20")
    colors = {a: palette(i % 20) for i, a in enumerate(arms)}
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.6), sharey=True)
    for ax, key, xlabel in ((axes[0], "heads", "realised heads (k/H, mean over test examples / tokens)"),
                            (axes[1], "flop_fraction", "analytic FLOP fraction of the whole model")):
        sweep = []
        for arm in arms:
            rs = [r for r in records if r["arm"] == arm and r.get(key) is not None]
            if not rs or (arm == "fixed_1" and any(r["arm"] == "standard" for r in records)):
                continue  # fixed_1: the same runs as "standard"
            fam = _arm_family(arm)
            color, marker = colors[arm], _STYLES[fam][1]
            acc = mean_ci([r["accuracy"] for r in rs])
            x = mean_ci([r[key] for r in rs])["mean"]
            ax.scatter([r[key] for r in rs], [r["accuracy"] for r in rs], color=color, s=8, alpha=0.35)
            if acc["lo"] is not None:
                err, ls = [[acc["mean"] - acc["lo"]], [acc["hi"] - acc["mean"]]], "-"
            else:
                n = rs[0].get("n_test") or 0
                half = 1.96 * math.sqrt(acc["mean"] * (1 - acc["mean"]) / n) if n else 0.0
                err, ls = [[half], [half]], "--"
            bars = ax.errorbar([x], [acc["mean"]], yerr=err, color=color, marker=marker, ms=5, capsize=3, ls="",
                               label=f"{arm} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
            bars[-1][0].set_linestyle(ls)
            if fam.startswith("fixed top-k sweep"):
                sweep.append((x, acc["mean"]))
        if len(sweep) > 1:
            sweep.sort()
            ax.plot([p[0] for p in sweep], [p[1] for p in sweep], color="tab:grey", lw=1, alpha=0.7)
        ax.set_xlabel(xlabel, fontsize=8)
        xs = [r[key] for r in records if r.get(key) is not None]
        ax.set_xlim(0 if key == "heads" or not xs else max(0.0, min(xs) - 0.08), 1.08)
    axes[0].set_ylabel("test accuracy")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="arm (seeds)", title_fontsize=7)
    fig.suptitle(title or "accuracy vs heads", fontsize=9)
    return save_figure(plt, fig, path)


def plot_head_heatmaps(freqs: dict[str, list[list[float]]], path: Path, title: str = "") -> bool:
    """One layer x head heatmap per arm: how often each head ran (mean over test examples, or tokens for MoH)."""
    plt = pyplot()
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
        bar = fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
        bar.set_label("share of test examples that ran the head (MoH: of tokens)", fontsize=7)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_difficulty(series: dict[str, list[dict[str, float]]], path: Path, title: str = "") -> bool:
    """Mean predicted budget s per equal-count bin (decile) of a difficulty proxy, one line per (proxy, seed);
    the legend gives each line's mean proxy value in the first and last bin."""
    plt = pyplot()
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
    return save_figure(plt, fig, path)


def plot_adaptivity(records: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Per layer: the share of test examples at each head count k, one bar per seed (the legend: the share off
    the layer's most common k); last panel: the share of examples at each budget s (10 bins of [0, 1]) per seed
    and layer."""
    plt = pyplot()
    rows = [r for r in records if r.get("adaptivity")]
    if plt is None or not rows:
        return False
    layers = sorted(rows[0]["adaptivity"]["layers"])
    fig, axes = plt.subplots(1, len(layers) + 1, figsize=(3.6 * (len(layers) + 1), 3.2), squeeze=False)
    width = 0.8 / len(rows)
    for ax, layer in zip(axes[0], layers):
        for i, r in enumerate(rows):
            a = r["adaptivity"]["layers"][layer]
            hist = a["k_hist"]
            ax.bar([k - 0.4 + (i + 0.5) * width for k in range(len(hist))], hist, width,
                   label=f"seed {r['seed']}: off mode {100 * a['k_off_mode']:.1f} %")
        ax.set_xticks(range(len(rows[0]["adaptivity"]["layers"][layer]["k_hist"])))
        ax.set_xlabel(f"{layer}: heads k per example", fontsize=8)
        ax.set_ylabel("share of test examples", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=6)
    ax = axes[0][-1]
    for r in rows:
        a = r["adaptivity"]
        for layer in layers:
            v = a["layers"][layer]
            ax.plot([i / 10 + 0.05 for i in range(10)], v["s_hist"], marker="o", ms=3, lw=1,
                    label=f"seed {r['seed']} {layer.split('.attn')[0]}: sd {v['s_sd']:.3f}")
    ax.set_xlabel("budget s per example (10 bins of [0, 1])", fontsize=8)
    ax.set_ylabel("share of test examples", fontsize=8)
    ax.set_xlim(0, 1)
    ax.legend(fontsize=6)
    fig.suptitle(title or "adaptivity", fontsize=9)
    return save_figure(plt, fig, path)

