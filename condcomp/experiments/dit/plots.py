"""The DiT study's figures (matplotlib, imported lazily) and its markdown table, drawn from ``OUT/summary.json``
and the runs' ``samples.pt``: sample grids, heads against the noise level, and quality against heads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from condcomp.experiments.plots import pyplot, save_figure

LABELS = {"dense": "dense", "moh_90": "MoH 90 %", "moh_75": "MoH 75 %", "moh_50": "MoH 50 %",
          "budgetformer_cond": "BudgetFormer (reads t)", "budgetformer": "BudgetFormer (tokens only)",
          "fixed": "fixed top-k (matched)"}


def load_summary(out: Path) -> dict[str, Any]:
    path = out / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `condcomp dit --out {out}` first")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def sample_tiles(grid: torch.Tensor, gap: int = 1) -> torch.Tensor:
    """``grid (10, k, S, S)`` (class, sample, pixel rows, pixel columns) in [-1, 1] -> one image
    ``(10 * (S + gap) - gap, k * (S + gap) - gap)``, rows = classes, NaN in the ``gap`` between digits (drawn in a
    colour of its own, so that neighbouring digits do not run together)."""
    C, k, S = grid.shape[0], grid.shape[1], grid.shape[-1]
    step = S + gap
    tiles = torch.full((C * step - gap, k * step - gap), float("nan"))
    for c in range(C):
        for j in range(k):
            tiles[c * step:c * step + S, j * step:j * step + S] = grid[c, j]
    return tiles


def draw_sample_grids(panels: list[tuple[str, torch.Tensor]], path: Path, columns: int = 3) -> bool:
    """One panel per ``(variant, grid (10, k, S, S))``, ``columns`` panels a row, every pixel square (the digits at
    their own aspect) and the panels large enough that a page's width shows each digit at about 30 pixels."""
    plt = pyplot() if panels else None
    if plt is None:
        return False
    rows = -(-len(panels) // columns)
    k = panels[0][1].shape[1]
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, rows * (3.4 * 10 / k + 0.4)), squeeze=False)
    cmap = plt.get_cmap("gray_r").with_extremes(bad="#c6dbef")  # the gaps between digits: pale blue
    for ax in axes.flat:
        ax.axis("off")
    for ax, (v, grid) in zip(axes.flat, panels):
        ax.imshow(sample_tiles(grid.float().clamp(-1, 1)).numpy(), cmap=cmap, vmin=-1, vmax=1, aspect="equal",
                  interpolation="nearest")
        ax.set_title(LABELS.get(v, v), fontsize=10)
    return save_figure(plt, fig, path)


def plot_samples(out: Path, variants: list[str], path: Path, seed: int = 0, per_class: int = 8) -> bool:
    """One panel per variant: ``per_class`` samples of each class (rows = classes), from ``seedS/V/samples.pt``."""
    panels = []
    for v in variants:
        p = out / f"seed{seed}" / v / "samples.pt"
        if p.is_file():
            imgs = torch.load(p, weights_only=True).float()  # (10 * n, 1, S, S), class-major
            n = imgs.shape[0] // 10
            panels.append((v, imgs.reshape(10, n, *imgs.shape[-2:])[:, :per_class]))  # (10, k, S, S)
    return draw_sample_grids(panels, path)


def plot_heads_vs_noise(summary: dict[str, Any], path: Path) -> bool:
    """Left: heads used (mean over layers) against the noise level t per routed variant. Right: per layer, the
    timestep-aware learned budget's heads and its budget s."""
    profiles = summary.get("noise_profiles", {})
    plt = pyplot() if profiles else None
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for v, prof in profiles.items():
        layers = list(prof["layers"].values())
        mean = [sum(ly["k_frac"][i] for ly in layers) / len(layers) for i in range(len(prof["t"]))]
        left.plot(prof["t"], mean, marker=".", label=f"{LABELS.get(v, v)} ({prof['seeds']} seeds)")
    left.set_xlabel("noise level t (1 = pure noise; sampling runs right to left)")
    left.set_ylabel("heads used (fraction, mean over layers)")
    left.set_title("heads per denoising step", fontsize=9)
    left.legend(fontsize=7)
    learned = profiles.get("budgetformer_cond") or profiles.get("budgetformer")
    if learned is not None:
        for i, ly in enumerate(learned["layers"].values()):
            line = right.plot(learned["t"], ly["k_frac"], marker=".", label=f"layer {i} heads")[0]
            right.plot(learned["t"], ly["s_mean"], ls="--", color=line.get_color(), alpha=0.6, label=f"layer {i} s")
        right.set_title("learned budget per layer (solid: heads k/H, dashed: budget s)", fontsize=9)
        right.set_xlabel("noise level t")
        right.legend(fontsize=6, ncol=2)
    return save_figure(plt, fig, path)


def plot_quality_vs_heads(summary: dict[str, Any], path: Path) -> bool:
    """Fréchet distance and class accuracy against heads used, mean and 95 % interval over seeds."""
    stats = summary.get("statistics", {})
    plt = pyplot() if stats else None
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    for ax, metric, label in ((axes[0], "frechet", "Fréchet distance (lower is better)"),
                              (axes[1], "class_accuracy", "class accuracy of samples")):
        for v, st in stats.items():
            m, h = st[metric], st["heads"]
            err = None if m["lo"] is None else [[m["mean"] - m["lo"]], [m["hi"] - m["mean"]]]
            ax.errorbar([h["mean"]], [m["mean"]], yerr=err, fmt="o", capsize=3, label=LABELS.get(v, v))
        ax.set_xlabel("heads used (fraction)")
        ax.set_ylabel(label)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.82, 0.5), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.82, 1))  # the legend's column right of the panels, outside the data
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def _fmt(st: dict[str, Any], digits: int = 3) -> str:
    if st["mean"] is None:
        return "-"
    if st["lo"] is None:
        return f"{st['mean']:.{digits}f}"
    return f"{st['mean']:.{digits}f} [{st['lo']:.{digits}f}, {st['hi']:.{digits}f}]"


def _seed_range(records: list[dict[str, Any]], variant: str, key: str, digits: int = 1) -> str:
    """Mean (min-max over seeds): for times, whose t-interval over a few loaded-machine seeds can reach below 0."""
    vals = sorted(float(r[key]) for r in records if r.get("variant") == variant and r.get(key) is not None)
    if not vals:
        return "-"
    mean = f"{sum(vals) / len(vals):.{digits}f}"
    return mean if len(vals) == 1 else f"{mean} ({vals[0]:.{digits}f}-{vals[-1]:.{digits}f})"


def markdown_table(summary: dict[str, Any]) -> str:
    """The results table: per variant, mean [95 % t-interval over seeds] of every metric but the sampling time,
    which shows the mean and the range over seeds."""
    head = ("| variant | seeds | Fréchet distance | class accuracy | heads used | attention FLOP fraction | "
            "sampling s, loaded CPU (range over seeds) |\n|---|---|---|---|---|---|---|")
    rows = [head]
    records = summary.get("records", [])
    for v, st in summary.get("statistics", {}).items():
        rows.append(f"| {LABELS.get(v, v)} | {st['frechet']['n']} | {_fmt(st['frechet'], 2)} | "
                    f"{_fmt(st['class_accuracy'])} | {_fmt(st['heads'])} | {_fmt(st['flop_fraction'])} | "
                    f"{_seed_range(records, v, 'sampling_seconds')} |")
    diff = summary.get("learned_minus_fixed", {})
    if diff.get("pairs"):
        rows.append(f"\nTimestep-aware budget minus fixed top-k at matched heads, paired by seed ({diff['pairs']} "
                    f"pairs): Fréchet distance {_fmt(diff['frechet'], 2)}, class accuracy "
                    f"{_fmt(diff['class_accuracy'])}, heads {_fmt(diff['heads'])}.")
    judge = summary.get("judge", {})
    rows.append(f"\nJudge (digits classifier, fixed): test accuracy {judge.get('test_accuracy', float('nan')):.3f}; "
                f"Fréchet distance of real train vs real test images: "
                f"{summary.get('reference_frechet_train_vs_test', float('nan')):.2f}.")
    return "\n".join(rows) + "\n"


def write_plots(out: Path) -> list[Path]:
    """Write ``OUT/plots/*.png`` and ``OUT/summary.md`` from the study folder; returns the written paths."""
    summary = load_summary(out)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    variants = list(summary.get("statistics", {}))
    written = []
    for name, ok in (("samples.png", lambda p: plot_samples(out, variants, p)),
                     ("heads_vs_noise.png", lambda p: plot_heads_vs_noise(summary, p)),
                     ("quality_vs_heads.png", lambda p: plot_quality_vs_heads(summary, p))):
        if ok(plots / name):
            written.append(plots / name)
    table = out / "summary.md"
    command = summary.get("command") or "condcomp dit"
    table.write_text(f"# DiT on digits: results\n\nMade by `{command}`; `condcomp dit --out {out} --plots-only` "
                     f"redraws the plots and this table.\n\n{markdown_table(summary)}")
    written.append(table)
    return written
