"""The words a study page uses for a paired comparison, from its statistics, by one rule for the whole project.

- **detected** ("a is better / worse"): only when the seed-level paired t interval (training noise) *and* the
  within-seed evidence on the test examples (the example bootstrap, else the exact McNemar test pooled over the
  seeds) exclude 0 in the same direction; the words show both.
- **matches**: only from an equivalence test, two one-sided t tests (TOST) over the seeds at the margin the rule
  holds (the 1 - 2 alpha interval inside +-margin), margin stated.
- otherwise **no difference detected**, with the size of the differences the 95 % interval does *not* exclude.

A seed-level interval that excludes 0 while the test examples do not (a 3-seed sd smaller than each seed's own
sampling error) is reported as "not established", never as a difference; so are test examples that exclude 0 while
the seed-level interval does not (never "matches", even where the TOST holds: the page then states both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def pooled_mcnemar(per_seed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The exact McNemar test on the discordant pairs summed over seeds (``a_only``: a right and b wrong)."""
    a_only = sum(int(m["a_only"]) for m in per_seed.values())
    b_only = sum(int(m["b_only"]) for m in per_seed.values())
    n = a_only + b_only
    p = 1.0
    if n:
        k = min(a_only, b_only)
        p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
    return {"a_only": a_only, "b_only": b_only, "p": p}


@dataclass(frozen=True)
class ClaimRule:
    """``margin``: the equivalence margin of "matches" (a difference in the compared quantity, 0.01 = 1 point of
    accuracy); ``alpha``: the tests' level; ``unit``/``what``: how differences are written (points)."""

    margin: float = 0.01
    alpha: float = 0.05
    unit: float = 100.0
    what: str = "points"

    def _pts(self, v: float) -> str:
        return f"{self.unit * v:+.2f}"

    def within_seed(self, comp: dict[str, Any]) -> tuple[int, str] | None:
        """(direction -1/0/+1, its words) of the within-seed evidence: the example bootstrap if kept, else the
        pooled McNemar test; None when neither is kept."""
        b = comp.get("bootstrap")
        if b:
            sign = 1 if b["lo"] > 0 else (-1 if b["hi"] < 0 else 0)
            kind = "examples" if b.get("resampled") == "examples" else "seeds and examples"
            return sign, f"bootstrap over {kind} [{self._pts(b['lo'])}, {self._pts(b['hi'])}]"
        if comp.get("mcnemar"):
            m = pooled_mcnemar(comp["mcnemar"])
            sign = 0 if m["p"] >= self.alpha else (1 if m["a_only"] > m["b_only"] else -1)
            return sign, f"McNemar pooled over seeds {m['a_only']} vs {m['b_only']}, p = {m['p']:.2g}"
        return None

    def equivalent(self, t: dict[str, Any]) -> tuple[float, float] | None:
        """The TOST interval (1 - 2 alpha t interval over seeds) when it lies inside +-margin, else None."""
        if t.get("sd") is None or t.get("n", 0) < 2:
            return None
        from scipy import stats as sps

        half = float(sps.t.ppf(1 - self.alpha, t["n"] - 1)) * t["sd"] / math.sqrt(t["n"])
        lo, hi = t["mean"] - half, t["mean"] + half
        return (lo, hi) if -self.margin < lo and hi < self.margin else None

    def words(self, comp: dict[str, Any]) -> str:
        """The verdict of one comparison of ``statistics.json`` (``seed_t``, ``bootstrap``, ``mcnemar``)."""
        t = comp.get("seed_t") or {}
        within = self.within_seed(comp)
        inside = f"within seeds: {within[1]}" if within else "no within-seed evidence kept"
        if t.get("mean") is None or "note" in t:
            return t.get("note") or "no seed-level statistics"
        if t.get("lo") is None:
            if within and within[0]:
                return f"one seed: no seed-level test; {inside} (the seed-to-seed spread is not in it)"
            return f"one seed: no seed-level test; no difference detected ({inside})"
        if t.get("sd") == 0:
            return (f"every seed differs by the same {self._pts(t['mean'])} {self.what}: no seed-level test; "
                    f"{inside}")
        lo, hi = t["lo"], t["hi"]
        seed = f"seed t [{self._pts(lo)}, {self._pts(hi)}]"
        sign = 1 if lo > 0 else (-1 if hi < 0 else 0)
        if sign:
            word = "better" if sign > 0 else "worse"
            if within and within[0] == sign:
                return f"detected: {word} ({seed}; {inside})"
            if within is None:
                return f"not established: the {seed} excludes 0, but no within-seed evidence is kept to confirm it"
            return f"not established: the {seed} excludes 0, the test examples do not ({inside})"
        eq = self.equivalent(t)
        tost = "" if eq is None else (f"; within +-{self.unit * self.margin:.2f} {self.what} by TOST "
                                      f"({100 * (1 - 2 * self.alpha):g} % interval [{self._pts(eq[0])}, "
                                      f"{self._pts(eq[1])}])")
        if within and within[0]:
            word = "better" if within[0] > 0 else "worse"
            return (f"not established: the test examples exclude 0 ({inside}: {word}), the {seed} does not"
                    f"{tost}")
        if eq is not None:
            return (f"matches within +-{self.unit * self.margin:.2f} {self.what} (TOST {100 * self.alpha:g} %, "
                    f"{100 * (1 - 2 * self.alpha):g} % interval [{self._pts(eq[0])}, {self._pts(eq[1])}])")
        bound = self.unit * max(abs(lo), abs(hi))
        return f"no difference detected; differences up to {bound:.2f} {self.what} not excluded ({inside})"

    def label(self, comp: dict[str, Any]) -> str:
        """A few words for a summary cell: "detected, better", "seed level only", "matches +-1", "none detected"."""
        w = self.words(comp)
        if w.startswith("detected"):
            return w.split(" (")[0].replace(":", ",")
        if w.startswith("not established: the test examples"):
            return "within seeds only, not established"
        if w.startswith("not established"):
            return "seed level only, not established"
        if w.startswith("matches"):
            return f"matches within +-{self.unit * self.margin:g}"
        if w.startswith("every seed"):
            return "no spread over seeds"
        return "none detected" if w.startswith("no difference") else w.split(";")[0]

    def not_excluded(self, comp: dict[str, Any]) -> float | None:
        """The largest difference the 95 % seed-level interval does not exclude (in ``unit``s), or None."""
        t = comp.get("seed_t") or {}
        if t.get("lo") is None:
            return None
        return self.unit * max(abs(t["lo"]), abs(t["hi"]))

    def short(self, comp: dict[str, Any]) -> str:
        """The first clause of :meth:`words`, for the summary table."""
        w = self.words(comp)
        for stop in (" (", "; within"):
            w = w.split(stop)[0]
        return w
