"""The adaptivity plot of one dataset's BudgetFormer runs (matplotlib, lazily; ``condcomp[report]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from condcomp.experiments.plots import _pyplot, _save


def plot_adaptivity(records: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Per layer: the share of test examples at each head count k, one bar per seed (the legend: the share off
    the layer's most common k); last panel: the share of examples at each budget s (10 bins of [0, 1]) per seed
    and layer."""
    plt = _pyplot()
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
    return _save(plt, fig, path)

