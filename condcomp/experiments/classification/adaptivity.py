"""How much a learned budget adapts to its input, from one run's per-example test predictions.

Per routed layer (``examples["layers"][name]``: per-example ``s``, head count ``k`` and head set ``heads`` as a
bit mask):

- ``s_mean``, ``s_sd``: the budget over examples; ``s_hist``: shares of examples in 10 equal bins of [0, 1].
- ``k_mode``: the most common head count; ``k_off_mode``: the share of examples whose k differs from it (0 means
  every example gets the same number of heads: a per-layer constant, not a per-input budget); ``k_sd``;
  ``k_hist``: the share of examples at each k = 0..H.
- ``set_entropy_bits``: the Shannon entropy (bits) of the head *set* across examples (0: every example runs the
  same heads; log2(C(H, k)) at most for one k), ``sets``: how many distinct sets occur, ``top_set_share``.

Over the whole model: ``s_sd`` of the per-example mean s, ``k_off_mode_any`` (k differs from its layer's mode in
at least one layer) and, given a difficulty per example (the standard model's loss), Spearman's rank
correlation of s and of the head count with it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from condcomp.experiments import stats as S


def entropy_bits(items: Sequence[Any]) -> float:
    """Shannon entropy (bits) of the empirical distribution of ``items``."""
    if not items:
        raise ValueError("entropy of an empty list of items")
    n = len(items)
    return -sum(c / n * math.log2(c / n) for c in Counter(items).values()) + 0.0


def _sd(values: Sequence[float]) -> float:
    return S.mean_ci(values)["sd"] or 0.0


def layer_adaptivity(s: Sequence[float], k: Sequence[int], num_heads: int,
                     heads: Sequence[int] | None = None) -> dict[str, Any]:
    """The measures above for one layer (``s``, ``k`` and ``heads`` per example, same order)."""
    n = len(k)
    if n == 0 or len(s) != n or (heads is not None and len(heads) != n):
        raise ValueError(f"layer adaptivity needs equally long, non-empty s, k (and heads): {len(s)}, {n}"
                         + (f", {len(heads)}" if heads is not None else ""))
    counts = Counter(int(v) for v in k)
    mode, at_mode = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))  # ties: the smaller k
    s_bins = [0] * 10
    for v in s:
        s_bins[min(9, max(0, int(float(v) * 10)))] += 1
    out: dict[str, Any] = {
        "s_mean": sum(s) / n, "s_sd": _sd(s), "s_hist": [c / n for c in s_bins],
        "k_mean": sum(k) / n, "k_sd": _sd([float(v) for v in k]), "k_mode": mode, "k_off_mode": 1 - at_mode / n,
        "k_hist": [counts.get(j, 0) / n for j in range(num_heads + 1)],
    }
    if heads is not None:
        sets = Counter(heads)
        out.update({"set_entropy_bits": entropy_bits(list(heads)), "sets": len(sets),
                    "top_set_share": max(sets.values()) / n})
    return out


def adaptivity(examples: dict[str, Any], num_heads: int,
               difficulty: Sequence[float] | None = None) -> dict[str, Any] | None:
    """The run's adaptivity record, or None when its examples carry no per-layer data."""
    layers = examples.get("layers")
    if not layers:
        return None
    per_layer = {name: layer_adaptivity(v["s"], v["k"], num_heads, v.get("heads")) for name, v in layers.items()}
    n = len(examples["s"])
    off_any = sum(any(layers[name]["k"][i] != per_layer[name]["k_mode"] for name in layers) for i in range(n)) / n
    out: dict[str, Any] = {"n": n, "s_sd": _sd(examples["s"]), "k_off_mode_any": off_any, "layers": per_layer}
    if difficulty is not None:
        if len(difficulty) != n:
            raise ValueError(f"difficulty has {len(difficulty)} values for {n} examples")
        out["spearman_difficulty_s"] = S.spearman(list(difficulty), examples["s"])
        out["spearman_difficulty_heads"] = S.spearman(list(difficulty), examples["k_frac"])
    return out


def mode_budgets(adapt: dict[str, Any]) -> dict[str, list[float]]:
    """Per layer ``[most common k, mean s]``: the constant budget of the per-input-adaptivity control."""
    return {name: [float(v["k_mode"]), float(v["s_mean"])] for name, v in adapt["layers"].items()}
