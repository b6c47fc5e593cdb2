"""``condcomp.experiments.stats``: ranks with NaN and the Student-t interval, against scipy (skipped without it).

The pure-Python t quantile (used when scipy is missing) is checked against scipy too, so the fallback is exact at
every df, not only where a table held it.
"""

from __future__ import annotations

import math
import random
import sys

import pytest

from condcomp.experiments import stats as S

sps = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("n", [2, 3, 5, 12, 31, 32, 33, 45, 80, 200, 1001])
def test_mean_ci_is_scipys_student_t_interval(n: int) -> None:
    rng = random.Random(n)
    vals = [rng.gauss(0.8, 0.03) for _ in range(n)]
    got = S.mean_ci(vals)
    lo, hi = sps.t.interval(0.95, n - 1, loc=sps.tmean(vals), scale=sps.sem(vals))
    assert got["lo"] == pytest.approx(lo, rel=1e-9, abs=1e-12)
    assert got["hi"] == pytest.approx(hi, rel=1e-9, abs=1e-12)


def test_mean_ci_without_scipy_is_still_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    vals = [0.81, 0.79, 0.84, 0.80] * 8  # n = 32: the old table switched to 1.96 after df 30
    lo, hi = sps.t.interval(0.95, 31, loc=sps.tmean(vals), scale=sps.sem(vals))
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy now fails
    got = S.mean_ci(vals)
    assert (got["lo"], got["hi"]) == pytest.approx((lo, hi), rel=1e-9)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 10, 30, 31, 32, 60, 99, 100, 1000])
@pytest.mark.parametrize("p", [0.975, 0.995, 0.9, 0.6])
def test_pure_python_t_quantile_matches_scipy(df: int, p: float) -> None:
    assert S.t_quantile(p, df) == pytest.approx(float(sps.t.ppf(p, df)), rel=1e-9)


def test_t_quantile_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="df"):
        S.t_quantile(0.975, 0)
    with pytest.raises(ValueError, match="probability"):
        S.t_quantile(1.0, 3)


def test_ranks_and_spearman_with_nan_follow_scipy() -> None:
    x = [1.0, math.nan, 0.5, math.nan]
    want = sps.rankdata(x)  # nan_policy "propagate": every rank NaN
    assert all(math.isnan(v) for v in S.ranks(x)) and all(math.isnan(v) for v in want)
    y = [2.0, 1.0, 3.0, 0.5]
    assert math.isnan(float(sps.spearmanr(x, y)[0]))
    rho = S.spearman(x, y)
    assert rho is not None and math.isnan(rho)
    rho = S.spearman(y, x)
    assert rho is not None and math.isnan(rho)
    rho = S.pearson(x, [1.0, 1.0, 1.0, 1.0])
    assert rho is not None and math.isnan(rho)  # NaN before "constant": scipy's pearsonr gives NaN too


def test_spearman_without_nan_matches_scipy_with_ties() -> None:
    rng = random.Random(3)
    x = [float(rng.randint(0, 5)) for _ in range(40)]
    y = [v + rng.gauss(0, 2) for v in x]
    assert S.ranks(x) == pytest.approx(list(sps.rankdata(x)))
    assert S.spearman(x, y) == pytest.approx(float(sps.spearmanr(x, y)[0]), rel=1e-12)
