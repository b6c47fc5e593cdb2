"""What every study's PNG plots share: matplotlib imported lazily (``pip install 'condcomp[report]'``; missing:
a note on stderr and no plot) and one way to write a figure."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None (with a note on stderr) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'condcomp[report]')", file=sys.stderr)
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> bool:
    """Lay out, write the PNG and free the figure (pyplot keeps every open figure alive otherwise)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
