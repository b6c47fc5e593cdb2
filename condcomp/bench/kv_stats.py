"""The statistics of ``condcomp bench kv``'s summary, all paired: every variant answers the same retrieval cases in
the same order and scores the same continuation tokens. Needs scipy (``pip install 'condcomp[report]'``).

- :func:`wilson`: a 95 % Wilson score interval of one variant's retrieval accuracy.
- :func:`mcnemar` (:mod:`condcomp.experiments.stats`): the exact McNemar test between two variants' per-case results.
- :func:`paired_difference_interval`: Newcombe's (1998) method 10 interval for the difference of two paired
  proportions (Wilson intervals of both, combined with the pairs' phi correlation); :func:`noninferiority` takes
  its one-sided lower bound against dense with the stated margin.
- :func:`ppl_ratio`: perplexity / dense's on the same tokens, with a percentile bootstrap over tokens (paired).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from condcomp.experiments.stats import mcnemar

__all__ = ["KVStats", "mcnemar", "noninferiority", "paired_difference_interval", "ppl_ratio", "wilson"]


@dataclass(frozen=True)
class KVStats:
    """The summary's statistical settings: ``margin``: the non-inferiority margin in accuracy (0.05: 5 points);
    ``alpha``: one-sided level of that bound (its interval is two-sided ``1 - 2 alpha``); ``confidence``: of the
    Wilson and bootstrap intervals; ``reps`` / ``seed``: of the bootstrap."""

    margin: float = 0.05
    alpha: float = 0.05
    confidence: float = 0.95
    reps: int = 2000
    seed: int = 0


def _z(confidence: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(0.5 + confidence / 2))


def wilson(hits: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``hits`` of ``n`` (scipy's ``binomtest(...).proportion_ci``)."""
    if n < 1 or not 0 <= hits <= n:
        raise ValueError(f"a Wilson interval needs 0 <= hits <= n and n >= 1, got {hits} of {n}")
    from scipy.stats import binomtest

    ci = binomtest(hits, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def paired_difference_interval(a: Sequence[bool], b: Sequence[bool], confidence: float = 0.95
                               ) -> tuple[float, float, float]:
    """``(acc(a) - acc(b), lo, hi)`` on paired cases: Newcombe's method 10 (no continuity correction)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired results must cover the same cases (>= 1), got {len(a)} and {len(b)}")
    n = len(a)
    both = sum(1 for x, y in zip(a, b) if x and y)
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    neither = n - both - a_only - b_only
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, u1 = wilson(both + a_only, n, confidence)
    l2, u2 = wilson(both + b_only, n, confidence)
    denom = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    phi = (both * neither - a_only * b_only) / math.sqrt(denom) if denom else 0.0
    d = p1 - p2
    lo = d - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    hi = d + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return d, lo, hi


def noninferiority(variant: Sequence[bool], dense: Sequence[bool], cfg: KVStats = KVStats()) -> dict[str, Any]:
    """Is the variant's retrieval within ``cfg.margin`` of dense's? ``lower``: the one-sided ``1 - alpha`` lower
    bound of acc(variant) - acc(dense); non-inferior when ``lower > -margin``."""
    d, lower, _ = paired_difference_interval(variant, dense, 1 - 2 * cfg.alpha)
    return {"diff": d, "lower": lower, "margin": cfg.margin, "alpha": cfg.alpha, "non_inferior": lower > -cfg.margin}


def _flat(windows: Sequence[Sequence[float]]) -> list[float]:
    return [float(x) for w in windows for x in w]


def ppl_ratio(variant: Sequence[Sequence[float]], dense: Sequence[Sequence[float]], cfg: KVStats = KVStats()
              ) -> dict[str, float]:
    """``exp(mean NLL - dense's mean NLL)`` over the same tokens (per-window lists of per-token NLLs), with a
    percentile bootstrap interval resampling tokens in pairs (scipy.stats.bootstrap). Tokens of one window are
    not independent, so the interval is the token-level part of the uncertainty."""
    import numpy as np
    from scipy.stats import bootstrap

    x, y = np.array(_flat(variant)), np.array(_flat(dense))
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"per-token NLLs must cover the same tokens (>= 1), got {x.size} and {y.size}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("non-finite per-token NLLs: the variant's logits overflowed; check the record")
    ratio = float(np.exp(x.mean() - y.mean()))
    if x.size < 2:
        return {"ratio": ratio, "lo": math.nan, "hi": math.nan}
    res = bootstrap((x - y,), lambda d, axis: np.exp(d.mean(axis=axis)), confidence_level=cfg.confidence,
                    n_resamples=cfg.reps, method="percentile", rng=np.random.default_rng(cfg.seed))
    return {"ratio": ratio, "lo": float(res.confidence_interval.low), "hi": float(res.confidence_interval.high)}
