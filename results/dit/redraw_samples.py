"""Redraw results/dit/plots/samples.png (seed 0, 8 samples per class) without the runs' samples.pt, which are not
committed: the samples are read back from the first drawing of the figure (commit 7aa2a24), where each 8x8 sample
pixel is a block of 4x4 screen pixels of one grey (imshow enlarged them by nearest neighbour).

Each sample pixel's value is read at its block's centre, from the gray_r colour (value = 1 - 2 * red / 255, exact
to 1/255 of the [-1, 1] range); the script checks that the four screen pixels around each centre hold the same
grey, so every value comes from one block and none from a blend.

    .venv/bin/python results/dit/redraw_samples.py    # from the repository root; needs git and matplotlib
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from condcomp.experiments.dit.plots import draw_sample_grids
from condcomp.experiments.plots import pyplot

HERE = Path(__file__).resolve().parent
FIRST_DRAWING = "7aa2a24:results/dit/plots/samples.png"
CLASSES, PER_CLASS, SIDE = 10, 8, 8


def first_drawing() -> np.ndarray:
    """The figure as committed in 7aa2a24, ``(H, W)`` red channel."""
    png = subprocess.run(["git", "-C", str(HERE), "show", FIRST_DRAWING], check=True, capture_output=True).stdout
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))[..., 0].astype(np.float64)


def block_centres(panels: int, height: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per panel, the screen rows and columns ``(80, 64)`` of each sample pixel's centre, from the first drawing's
    layout (2.4 x 3.4 inches a panel, tight layout, 120 dpi), rebuilt with placeholder images."""
    plt = pyplot()
    fig, axes = plt.subplots(1, panels, figsize=(2.4 * panels, 3.4), squeeze=False)
    for ax in axes[0]:
        ax.imshow(np.zeros((CLASSES * SIDE, PER_CLASS * SIDE)), cmap="gray_r", vmin=-1, vmax=1)
        ax.set_title("x", fontsize=8)
        ax.axis("off")
    fig.tight_layout()
    fig.set_dpi(120)
    fig.canvas.draw()
    cols, rows = np.meshgrid(np.arange(PER_CLASS * SIDE), np.arange(CLASSES * SIDE))
    centres = []
    for ax in axes[0]:
        xy = ax.transData.transform(np.stack([cols.ravel(), rows.ravel()], -1))
        centres.append((np.floor(height - xy[:, 1]).astype(int).reshape(rows.shape),
                        np.floor(xy[:, 0]).astype(int).reshape(cols.shape)))
    plt.close(fig)
    return centres


def read_back(red: np.ndarray, variants: list[str]) -> list[tuple[str, torch.Tensor]]:
    panels = []
    for v, (r, c) in zip(variants, block_centres(len(variants), red.shape[0])):
        block = red[r, c]  # (80, 64)
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            if not np.array_equal(red[r + dr, c + dc], block):
                raise RuntimeError(f"{v}: a sample pixel's block is not one grey: the layout does not match")
        values = torch.from_numpy(1.0 - 2.0 * block / 255.0).float()  # (10 * 8, 8 * 8), rows = classes
        grid = values.reshape(CLASSES, SIDE, PER_CLASS, SIDE).permute(0, 2, 1, 3)  # (10, 8, 8, 8)
        panels.append((v, grid))
    return panels


def main() -> None:
    variants = list(json.loads((HERE / "summary.json").read_text())["statistics"])
    panels = read_back(first_drawing(), variants)
    draw_sample_grids(panels, HERE / "plots" / "samples.png")
    print(f"wrote {HERE / 'plots' / 'samples.png'} ({len(panels)} panels)")


if __name__ == "__main__":
    main()
