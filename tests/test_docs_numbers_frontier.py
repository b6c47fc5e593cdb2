"""docs/kv-frontier.md, the DuoAttention split against byte targets (issue 50), against the committed records.

Recomputed here from `results/kv_facts_1024/records` (json and scipy, not condcomp's statistics code):

- each row of the targets table: bytes, keys found with the Wilson interval, the exact McNemar test against
  dense, perplexity / dense's (its bootstrap interval is checked with every page's intervals,
  `test_docs_numbers.py`), the one-sided 95 % non-inferiority bound against dense (Newcombe's paired interval,
  method 10, written out below in float64) and the verdict against the target's margin, the bytes against the
  target's bytes, and the exact McNemar test against the best press at most its bytes where the target asks;
- the Pareto set the page names: the records no other record dominates (at most the bytes, at least the keys);
- the screen's records pair with the 100-case records: its first 20 cases are theirs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

sps = pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "results" / "kv_facts_1024" / "records"
SCREEN = ROOT / "results" / "kv_frontier_screen" / "records"
AWARE = ROOT / "results" / "kv_facts_aware_1024" / "records"  # question-aware, 100 cases


def _record(name: str, folder: Path = RECORDS) -> dict:
    return json.loads((folder / f"{name}@1024.json").read_text())


def _section() -> str:  # the frontier (the page's quotes-task table: test_docs_numbers_quotes.py)
    return (ROOT / "docs" / "kv-frontier.md").read_text().split("## A task of another kind")[0]


def _rows() -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in _section().splitlines()
            if line.startswith("| ") and "`" in line]


def _wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def _lower_bound(a: list[bool], b: list[bool], alpha: float = 0.05) -> tuple[float, float]:
    """``(acc(a) - acc(b), its one-sided 1 - alpha lower bound)``: Newcombe (1998) method 10."""
    n = len(a)
    both = sum(x and y for x, y in zip(a, b))
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    neither = n - both - a_only - b_only
    z = float(sps.norm.ppf(1 - alpha))
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, _ = _wilson(both + a_only, n, z)
    _, u2 = _wilson(both + b_only, n, z)
    denom = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    phi = (both * neither - a_only * b_only) / math.sqrt(denom) if denom else 0.0
    return p1 - p2, p1 - p2 - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)


def _mcnemar(a: list[bool], b: list[bool]) -> tuple[int, int, float]:
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    return only_a, only_b, float(sps.binomtest(only_a, only_a + only_b).pvalue) if only_a + only_b else 1.0


def _folder(cells: list[str]) -> Path:
    """The records a target row reads: the question-aware mode's own (measured with the question seen), else the
    study's."""
    return AWARE if "question-aware" in cells[0] else RECORDS


def test_the_bound_reproduces_a_committed_summary_cell() -> None:
    """The rule above gives the bound kv_facts_1024's summary.md printed for the split (its own code's number)."""
    diff, lower = _lower_bound(_record("split-duo-1of3")["retrieval_correct"], _record("dense")["retrieval_correct"])
    assert f"{diff * 100:+.1f} (>= {lower * 100:+.1f})" == "-16.0 (>= -22.8)"


def test_each_target_row_is_its_record() -> None:
    """Row: | target | use (the variant in backticks) | bytes | found | vs dense | ppl | bound | verdict |. The
    target cell names its bytes (<= x) and margin (within m points); the verdict says met, or by how many points
    the bound misses the margin."""
    rows = _rows()
    assert len(rows) == 4
    assert f"Dense finds {sum(_record('dense')['retrieval_correct'])} of 100." in " ".join(_section().split())
    for cells in rows:
        variant = re.findall(r"`([^`]+)`", cells[1])[-1]
        folder = _folder(cells)
        r, dense_record = _record(variant, folder), _record("dense", folder)
        dense = dense_record["retrieval_correct"]
        limit = float(re.search(r"<= (\d\.\d+)x", cells[0]).group(1))  # type: ignore[union-attr]
        margin = float(re.search(r"within (\d+) points", cells[0]).group(1))  # type: ignore[union-attr]
        assert r["kv_frac"] <= limit and cells[2] == f"{r['kv_frac']:.3f}", variant
        assert "quantization" not in cells[0] or ("with quantization" in cells[0]) == ("+" in variant), variant
        hits = r["retrieval_correct"]
        ci = sps.binomtest(sum(hits), len(hits)).proportion_ci(0.95, method="wilson")
        of = "" if len(hits) == 100 else f" of {len(hits)}"  # a screen's row says how many cases
        assert cells[3] == f"{sum(hits)}{of} [{ci.low * 100:.0f}, {ci.high * 100:.0f}]", variant
        assert (len(hits) < 100) == (f"({len(hits)} cases: a screen)" in cells[1]), variant
        a, b, p = _mcnemar(hits, dense)
        assert cells[4] == f"{a} / {b}, " + (f"p {p:.3f}" if p >= 0.001 else "p < 0.001"), variant
        assert cells[5].startswith(f"{r['ppl'] / dense_record['ppl']:.3f} ["), variant
        if (ppl_target := re.search(r"perplexity <= (\d\.\d+)x", cells[0])) is not None:  # met or not, as stated
            assert ("perplexity met" in cells[7]) == (r["ppl"] / dense_record["ppl"] <= float(ppl_target[1])), variant
        diff, lower = _lower_bound(r["retrieval_correct"], dense)
        assert cells[6] == f"{diff * 100:+.1f} (>= {lower * 100:+.1f})", variant
        short = -margin - lower * 100
        verdict = "met" if short < 0 else f"missed: the bound is {short:.1f} points short of -{margin:.0f}"
        assert cells[7].startswith(verdict), variant
        if "every press" in cells[0]:  # the test against the best kvpress press holding at most its bytes
            presses = [p for p in (_record(f.name.split("@")[0]) for f in RECORDS.glob("kvpress-*@1024.json"))
                       if p.get("nominal_frac") is None and p["kv_frac"] <= r["kv_frac"] + 0.01]
            best = max(presses, key=lambda p: sum(p["retrieval_correct"]))
            a, b, p = _mcnemar(r["retrieval_correct"], best["retrieval_correct"])
            assert f"{a} / {b} against `{best['variant']}` ({sum(best['retrieval_correct'])}), p = {p:.2g}" in cells[7]


def test_the_named_pareto_set_is_the_undominated_records() -> None:
    records = [json.loads(f.read_text()) for f in sorted(RECORDS.glob("*@1024.json"))]
    found = {r["variant"]: (r["kv_frac"], sum(r["retrieval_correct"])) for r in records}
    front = sorted((v for v, (b, k) in found.items()
                    if not any(b2 <= b and k2 >= k and (b2, k2) != (b, k) for b2, k2 in found.values())),
                   key=lambda v: found[v][0])
    sentence = " ".join(_section().split())
    named = re.search(r"The Pareto set at 1024 tokens[^:]*: (.*?)\. ", sentence)
    assert named is not None
    quoted = re.findall(r"`([^`]+)` \((\d\.\d{3})x, (\d+)\)", named.group(1))
    assert [v for v, _, _ in quoted] == front
    assert all((f"{found[v][0]:.3f}", str(found[v][1])) == (b, k) for v, b, k in quoted)


def test_the_screens_cases_are_the_first_of_the_decisions() -> None:
    """The screen's dense and 1/6-w92 records (20 cases) are the first 20 of the 100-case records, per case and per
    scored token: the same cases, so the screen's choices pair with the decisions."""
    for name in ("dense", "split-duo-1of6-w92"):
        screen, full = _record(name, SCREEN), _record(name)
        assert screen["settings"]["passkey_cases"] == 20 and full["settings"]["passkey_cases"] == 100
        assert screen["retrieval_correct"] == full["retrieval_correct"][:20]
        assert screen["token_nll"] == full["token_nll"] and screen["kv_bytes"] == full["kv_bytes"]
