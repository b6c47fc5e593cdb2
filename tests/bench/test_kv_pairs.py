"""condcomp.bench.kv_pairs against hand counts, a hand-summed exact binomial tail and Newcombe's method 10 written out
here in float64 (closed-form Wilson limits), on hand-made records and on the committed 100-case records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("scipy")

from condcomp.bench.kv_pairs import compare, pairs_table  # noqa: E402
from condcomp.bench.kv_stats import KVStats  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _newcombe_lower(a: list[bool], b: list[bool], z: float) -> float:
    n = len(a)
    both = sum(x and y for x, y in zip(a, b))
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    neither = n - both - a_only - b_only

    def wilson(k: int) -> tuple[float, float]:
        p = k / n
        centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)

    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, _ = wilson(both + a_only)
    _, u2 = wilson(both + b_only)
    denom = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    phi = (both * neither - a_only * b_only) / math.sqrt(denom) if denom else 0.0
    return p1 - p2 - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)


def test_compare_counts_tests_and_bounds_by_hand() -> None:
    # 10 cases: both 4, only a 4, only b 1, neither 1
    a = [True] * 8 + [False, False]
    b = [True] * 4 + [False] * 4 + [True, False]
    c = compare(a, b)
    assert (c["a_only"], c["b_only"]) == (4, 1)
    assert c["p"] == pytest.approx(2 * (1 + 5) / 2**5)  # two-sided exact tail of Bin(5, 1/2) at 1: 0.375
    assert c["diff"] == pytest.approx(0.3)
    assert c["lower"] == pytest.approx(_newcombe_lower(a, b, 1.6448536269514722), abs=1e-12)
    looser = compare(a, b, KVStats(alpha=0.025))
    assert looser["lower"] == pytest.approx(_newcombe_lower(a, b, 1.959963984540054), abs=1e-12)
    assert looser["lower"] < c["lower"]
    same = compare([True, False], [True, False])
    assert (same["a_only"], same["b_only"], same["p"], same["diff"]) == (0, 0, 1.0, 0.0)


def test_compare_refuses_unpaired_results() -> None:
    with pytest.raises(ValueError, match="same cases"):
        compare([True, False], [True])


def _write(folder: Path, name: str, hits: list[bool], frac: float) -> None:
    (folder / f"{name}@1024.json").write_text(json.dumps({"retrieval_correct": hits, "kv_frac": frac}))


def test_pairs_table_rows_and_missing_records(tmp_path: Path) -> None:
    _write(tmp_path, "dense", [True, True, True, False], 1.0)
    _write(tmp_path, "half", [True, False, False, True], 0.5)
    table = pairs_table(tmp_path, [("half", "dense", "half against dense"), ("quarter", "dense", "not run")])
    lines = table.splitlines()
    lower = _newcombe_lower([True, False, False, True], [True, True, True, False], 1.6448536269514722)
    assert lines[2] == (f"| half (0.500x) | dense (1.000x) | 2 | 3 | 1 / 2 | 1 | -25.0 (>= {lower * 100:+.1f}) | "
                        "half against dense |")
    assert lines[-1] == "Not measured (a record missing): quarter / dense."
    _write(tmp_path, "short", [True], 0.25)
    with pytest.raises(ValueError, match="different case lists"):
        pairs_table(tmp_path, [("short", "dense", "")])


def test_the_committed_bound_of_the_split() -> None:
    """kv_facts_1024's summary.md (written by the bench's report) printed -16.0 (>= -22.8) for the split."""
    folder = ROOT / "results" / "kv_facts_1024" / "records"
    row = pairs_table(folder, [("split-duo-1of3", "dense", "")]).splitlines()[2]
    assert "| 63 | 79 | 2 / 18 |" in row and "| -16.0 (>= -22.8) |" in row
