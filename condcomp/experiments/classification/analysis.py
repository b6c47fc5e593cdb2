"""Budget versus input difficulty, from an ablation folder's per-example files.

Difficulty proxies (each example of the test split):

- ``confidence``: the standard model's probability of the true class. Independent of the model whose budget is
  studied, and it measures difficulty *for this architecture*: low = hard.
- ``overlap`` (sentence pairs): the fraction of hypothesis words found in the premise. High overlap pairs are the
  lexically easy ones (mostly entailment, decidable by matching), low overlap needs more reasoning.
- ``tag``: the difficulty a synthetic task assigns by construction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def _bins(values: torch.Tensor, n: int) -> list[tuple[float, float, torch.Tensor]]:
    qs = torch.quantile(values, torch.linspace(0, 1, n + 1, dtype=values.dtype))
    out = []
    for i in range(n):
        lo, hi = float(qs[i]), float(qs[i + 1])
        idx = (values >= lo) & ((values < hi) if i < n - 1 else (values <= hi))
        out.append((lo, hi, idx))
    return out


def budget_by_proxy(study_dir: Path, arm: str = "budgetformer", n_bins: int = 3) -> dict[str, Any]:
    """Per proxy: rows of (bin range, n, mean s, realised heads, accuracy of ``arm``), easiest bin last."""
    ex = json.loads((study_dir / arm / "examples.json").read_text())
    s, k = torch.tensor(ex["s"], dtype=torch.float64), torch.tensor(ex["k_frac"], dtype=torch.float64)
    ok = torch.tensor(ex["correct"], dtype=torch.float64)
    proxies: dict[str, torch.Tensor] = {}
    std_file = study_dir / "standard" / "examples.json"
    if std_file.is_file():
        proxies["confidence"] = torch.tensor(json.loads(std_file.read_text())["prob_true"], dtype=torch.float64)
    if ex.get("overlap"):
        proxies["overlap"] = torch.tensor(ex["overlap"], dtype=torch.float64)
    out: dict[str, Any] = {}
    for name, v in proxies.items():
        rows = {}
        for i, (lo, hi, idx) in enumerate(_bins(v, n_bins)):
            label = f"{name} bin {i + 1}/{n_bins} [{lo:.3f}, {hi:.3f}]"
            rows[label] = {"n": int(idx.sum()), "s_mean": float(s[idx].mean()), "k_frac": float(k[idx].mean()),
                           "accuracy": float(ok[idx].mean())}
        corr = float(torch.corrcoef(torch.stack([v, s]))[0, 1])
        out[name] = {"rows": rows, "pearson_s": corr}
    if ex.get("tags"):
        tags = ex["tags"]
        out["tag"] = {"rows": {t: {"n": sum(x == t for x in tags),
                                   "s_mean": float(s[torch.tensor([x == t for x in tags])].mean()),
                                   "k_frac": float(k[torch.tensor([x == t for x in tags])].mean()),
                                   "accuracy": float(ok[torch.tensor([x == t for x in tags])].mean())}
                               for t in sorted(set(tags))}}
    return out
