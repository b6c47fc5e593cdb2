"""Statistics of a multi-seed study: intervals over seeds, paired tests on the test predictions, power, rank and
linear correlation. The seed-level test and the power need scipy (``pip install 'condcomp[report]'``).

- :func:`mean_ci`: mean and a 95 % Student-t interval over seeds (n - 1 degrees of freedom); scipy's quantile
  when installed, else the exact pure-Python :func:`t_quantile`.
- :func:`paired_t`: the headline test: per-seed accuracy differences of two arms trained with the same seeds,
  Student t over seeds (df = seeds - 1). The seed is the unit of replication: it carries the training noise.
- :func:`min_detectable_difference`: the true mean difference that test detects with 80 % power at the
  observed seed-to-seed sd; :func:`seeds_needed` for a target difference.
- :func:`paired_bootstrap`: on the *same* test examples; with ``resample_seeds=False`` only the test examples
  are resampled (the within-seed, test-sample part of the uncertainty); by default it is the two-stage
  bootstrap: each replicate draws the seeds with replacement, then the examples independently within each drawn
  seed (the seed draw cannot leave the range of the per-seed values: with 3 seeds it understates the
  seed-to-seed part; use :func:`paired_t` for that).
- :func:`mcnemar`: the exact McNemar test of one seed (two-sided binomial on the discordant pairs).
- :func:`verdict`: "better" / "worse" when the bootstrap interval excludes 0, else "no difference at this power".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any


def student_t_cdf_two_sided(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with integer ``df``: the finite series of Abramowitz & Stegun 26.7.3-4
    (exact up to float rounding; no table, no approximation), with ``theta = atan(t / sqrt(df))``."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), the sum up to cos^(df-3)
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term = total = 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), the sum up to cos^(df-2)
    for j in range(1, df // 2):
        term *= c2 * (2 * j - 1) / (2 * j)
        total += term
    return math.sin(theta) * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with integer ``df``, in pure Python (bisection on the exact CDF of
    :func:`student_t_cdf_two_sided`): the fallback of :func:`mean_ci` without scipy."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"t quantile needs an integer df >= 1, got {df!r}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"t quantile needs a probability strictly between 0 and 1, got {p!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    target = 2.0 * p - 1.0  # P(|T| <= t) at the quantile
    lo, hi = 0.0, 1.0
    while student_t_cdf_two_sided(hi, df) < target:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if student_t_cdf_two_sided(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def t975(df: int) -> float:
    """The two-sided 95 % quantile of Student's t: scipy's when installed (the ``report`` extra), else
    :func:`t_quantile`."""
    try:
        from scipy import stats as sps
    except ImportError:
        return t_quantile(0.975, df)
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"t quantile needs an integer df >= 1, got {df!r}")
    return float(sps.t.ppf(0.975, df))


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
    """``{"n", "mean", "sd", "lo", "hi"}``; one value gives no interval (lo = hi = None)."""
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "lo": None, "hi": None}
    m = sum(vals) / n
    if n == 1:
        return {"n": 1, "mean": m, "sd": None, "lo": None, "hi": None}
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": m, "sd": sd, "lo": m - half, "hi": m + half}


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> dict[str, Any]:
    """Exact two-sided McNemar test: ``b_only`` = a wrong & b right ... on paired correctness vectors."""
    if len(a) != len(b):
        raise ValueError(f"paired vectors differ in length: {len(a)} vs {len(b)}")
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    n = a_only + b_only
    if n == 0:
        p = 1.0
    else:
        k = min(a_only, b_only)
        # P(X <= k) for X ~ Bin(n, 1/2), doubled; exact integer arithmetic, then one division.
        tail = sum(math.comb(n, i) for i in range(k + 1))
        p = min(1.0, float(Fraction(2 * tail, 2**n)))
    return {"n": len(a), "a_only": a_only, "b_only": b_only, "p": p}


def paired_bootstrap(a: Sequence[Sequence[bool]], b: Sequence[Sequence[bool]], reps: int = 2000,
                     seed: int = 0, resample_seeds: bool = True) -> dict[str, Any]:
    """Accuracy difference a - b (mean over seeds) with a 95 % percentile interval and a two-sided p.

    ``a[s]`` and ``b[s]`` are the correctness vectors of seed ``s`` on the same test examples (same order).
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number (>= 1) of seeds for both arms, got {len(a)} and {len(b)}")
    n = len(a[0])
    if any(len(x) != n for x in list(a) + list(b)):
        raise ValueError("every correctness vector must cover the same test examples")
    import torch

    diffs = torch.tensor([[int(x) - int(y) for x, y in zip(sa, sb)] for sa, sb in zip(a, b)],
                         dtype=torch.float64)  # (S, n)
    S = diffs.shape[0]
    observed = float(diffs.mean())
    g = torch.Generator().manual_seed(seed)
    stats: list[float] = []
    chunk = max(1, 2_000_000 // max(1, n * S))
    while len(stats) < reps:
        m = min(chunk, reps - len(stats))
        if not resample_seeds:  # every seed once, on one resample of the test examples they share
            idx = torch.randint(n, (m, n), generator=g)  # (m, n): examples drawn with replacement
            stats += diffs[:, idx].mean(-1).mean(0).tolist()  # (S, m) -> (m,)
            continue
        # the two-stage bootstrap: the seeds drawn with replacement, then the examples independently within each
        # drawn seed (a seed drawn twice gets two independent example resamples)
        seeds = torch.randint(S, (m, S, 1), generator=g)  # (m, S, 1)
        idx = torch.randint(n, (m, S, n), generator=g)  # (m, S, n)
        stats += diffs[seeds, idx].mean(-1).mean(-1).tolist()  # (m, S, n) -> (m,)
    stats.sort()
    lo, hi = stats[int(0.025 * reps)], stats[min(reps - 1, int(0.975 * reps))]
    below = sum(1 for v in stats if v <= 0) / reps
    above = sum(1 for v in stats if v >= 0) / reps
    return {"diff": observed, "lo": lo, "hi": hi, "p": min(1.0, 2 * min(below, above)), "reps": reps,
            "seeds": S, "n": n, "resampled": "seeds and examples" if resample_seeds else "examples"}


def paired_t(diffs: Sequence[float], alpha: float = 0.05) -> dict[str, Any]:
    """Mean of per-seed differences with its two-sided ``1 - alpha`` Student-t interval (df = n - 1) and p.

    Fewer than two seeds: no interval (``lo``/``hi``/``p`` None). Identical differences: a zero-width interval
    at the mean (sd 0) and p 0 unless the mean is 0 too.
    """
    from scipy import stats as sps

    d = [float(v) for v in diffs]
    n = len(d)
    mean = sum(d) / n if n else None
    out: dict[str, Any] = {"n": n, "df": n - 1, "mean": mean, "sd": None, "lo": None, "hi": None, "p": None}
    if n < 2 or mean is None:
        return out
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
    half = float(sps.t.ppf(1 - alpha / 2, n - 1)) * sd / math.sqrt(n)
    if sd > 0:
        p = float(2 * sps.t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))
    else:
        p = 1.0 if mean == 0 else 0.0
    out.update({"sd": sd, "lo": mean - half, "hi": mean + half, "p": p})
    return out


def t_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided one-sample (paired) t test with ``n`` seeds to detect a true mean ``effect``.

    The noncentral t probability written as an integral over the chi-square of the sd estimate:
    ``T = (Z + nc) / sqrt(V / df)``, so ``P(|T| > c) = E_V[Phi(nc - c r) + Phi(-nc - c r)]``, ``r = sqrt(V / df)``
    (scipy's ``nct`` returns NaN for large noncentralities at df = 1 or 2).
    """
    from scipy import integrate
    from scipy import stats as sps

    df, nc = n - 1, effect * math.sqrt(n) / sd
    crit = float(sps.t.ppf(1 - alpha / 2, df))

    log_norm = (df / 2) * math.log(2) + math.lgamma(df / 2)

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def integrand(v: float) -> float:  # plain math: quad calls it hundreds of times
        r = math.sqrt(v / df)
        density = math.exp((df / 2 - 1) * math.log(v) - v / 2 - log_norm) if v > 0 else 0.0  # chi2(df) pdf
        return (phi(nc - crit * r) + phi(-nc - crit * r)) * density

    lo, hi = float(sps.chi2.ppf(1e-12, df)), float(sps.chi2.ppf(1 - 1e-12, df))
    return float(integrate.quad(integrand, lo, hi, limit=200)[0])


def min_detectable_difference(sd: float | None, n: int, power: float = 0.8, alpha: float = 0.05) -> float | None:
    """The smallest true mean difference the paired t over ``n`` seeds detects with ``power`` (noncentral t),
    given the seed-to-seed sd of the differences; None without an sd (fewer than 2 seeds) or when the seeds
    show no spread (sd 0: the observed spread says nothing about the spread of a rerun, so no power estimate)."""
    if sd is None or n < 2 or sd == 0:
        return None
    from scipy.optimize import brentq

    top = sd
    while t_power(top, sd, n, alpha) < power:  # bracket: power grows with the effect
        top *= 2
    return float(brentq(lambda e: t_power(e, sd, n, alpha) - power, 0.0, top, xtol=1e-9 * sd))


def seeds_needed(sd: float | None, target: float, power: float = 0.8, alpha: float = 0.05,
                 most: int = 1000) -> int | None:
    """The fewest seeds whose :func:`min_detectable_difference` is <= ``target`` (None: more than ``most``)."""
    if sd is None:
        return None

    def ok(n: int) -> bool:
        mdd = min_detectable_difference(sd, n, power, alpha)
        return mdd is not None and mdd <= target

    if not ok(most):
        return None
    lo, hi = 1, most  # not ok(lo) (one seed detects nothing), ok(hi); the MDD falls as seeds are added
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def seed_verdict(t: dict[str, Any], unit: float = 100.0, what: str = "points") -> str:
    """Words that follow a :func:`paired_t` result (``unit`` scales the difference, e.g. to points)."""
    if t.get("lo") is None:
        return "one seed: no seed-level interval"
    if t.get("sd") == 0:  # e.g. two seeds that differ by the same number of test examples: no spread to test
        return (f"every seed differs by the same {unit * t['mean']:+.2f} {what}: the seeds show no spread, so no "
                "seed-level test (see the within-seed bootstrap)")
    lo, hi = unit * t["lo"], unit * t["hi"]
    if lo > 0:
        return f"better (by {lo:.2f} to {hi:.2f} {what})"
    if hi < 0:
        return f"worse (by {-hi:.2f} to {-lo:.2f} {what})"
    bound = max(abs(lo), abs(hi))
    return f"no difference detected; differences above {bound:.2f} {what} excluded"


def verdict(lo: float, hi: float) -> str:
    if lo > 0:
        return "better"
    if hi < 0:
        return "worse"
    return "no difference at this power"


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    n = len(x)
    if n != len(y) or n < 3:
        return None
    if any(math.isnan(v) for v in [*x, *y]):
        return math.nan  # as scipy: undefined, not a number computed around the gap
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((v - mx) ** 2 for v in x)
    syy = sum((v - my) ** 2 for v in y)
    if sxx == 0 or syy == 0:
        return None  # a constant: no correlation defined
    return sum((u - mx) * (v - my) for u, v in zip(x, y)) / math.sqrt(sxx * syy)


def ranks(x: Sequence[float]) -> list[float]:
    """Average ranks (ties share the mean of their positions), 1-based. A NaN anywhere makes every rank NaN (as
    scipy's ``rankdata``): NaN has no place in an order, and ranks computed around it would be wrong."""
    if any(math.isnan(v) for v in x):
        return [math.nan] * len(x)
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for t in range(i, j + 1):
            out[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson's correlation of the ranks; NaN when a value is NaN (as scipy), None as :func:`pearson`."""
    return pearson(ranks(x), ranks(y))


def binned_means(x: Sequence[float], y: Sequence[float], bins: int = 10) -> list[dict[str, float]]:
    """Equal-count bins of ``x``: per bin the x range, the mean x and the mean y (for plots of y against x)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = []
    for b in range(bins):
        part = order[b * len(order) // bins:(b + 1) * len(order) // bins]
        if not part:
            continue
        xs, ys = [x[i] for i in part], [y[i] for i in part]
        out.append({"n": len(part), "x_lo": xs[0], "x_hi": xs[-1], "x_mean": sum(xs) / len(xs),
                    "y_mean": sum(ys) / len(ys)})
    return out
