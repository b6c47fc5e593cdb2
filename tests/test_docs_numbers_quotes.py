"""docs/kv-frontier.md's quotes-task table against `results/kv_quotes_1024/records` (json and scipy, not condcomp's
statistics code): bytes, keys found, and the exact McNemar tests the table names; the one-sided bound the text
quotes is recomputed with Newcombe's method 10 as in test_docs_numbers_frontier."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

sps = pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "results" / "kv_quotes_1024" / "records"


def _correct(name: str) -> tuple[list[bool], float]:
    record = json.loads((RECORDS / f"{name}@1024.json").read_text())
    return record["retrieval_correct"], record["kv_frac"]


def _section() -> str:
    text = (ROOT / "docs" / "kv-frontier.md").read_text()
    return text.split("## A task of another kind")[1].split("\n## ")[0]


def _mcnemar(a: str, b: str) -> tuple[int, int, float]:
    ca, cb = _correct(a)[0], _correct(b)[0]
    only_a = sum(x and not y for x, y in zip(ca, cb, strict=True))
    only_b = sum(y and not x for x, y in zip(ca, cb, strict=True))
    return only_a, only_b, float(sps.binomtest(only_a, only_a + only_b, 0.5).pvalue)


def test_every_row_of_the_quotes_table_is_its_records() -> None:
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in _section().splitlines()
            if line.startswith("| ") and not line.startswith("| variant")]
    assert [r[0].strip("`") for r in rows] == ["dense", "split-duo-1of3", "split-duo-1of6-w92"]
    for name, frac, found, against in rows:
        correct, kv_frac = _correct(name.strip("`"))
        assert len(correct) == 100 and frac == f"{kv_frac:.3f}" and int(found) == sum(correct)
        matches = list(re.finditer(r"(dense|`([\w.-]+)` \((\d+)\)): (\d+) / (\d+), p (< 0\.001|[\d.]+)", against))
        assert len(matches) == against.count(", p ")  # every test the row names is checked
        for m in matches:
            other = "dense" if m.group(1) == "dense" else m.group(2)
            if m.group(3) is not None:
                assert int(m.group(3)) == sum(_correct(other)[0])
            only_a, only_b, p = _mcnemar(name.strip("`"), other)
            assert (only_a, only_b) == (int(m.group(4)), int(m.group(5)))
            assert (m.group(6) == "< 0.001" and p < 0.001) or f"{p:.3f}" == m.group(6)


def test_the_half_bytes_bound_against_dense() -> None:
    from test_docs_numbers_frontier import _lower_bound

    diff, bound = _lower_bound(_correct("split-duo-1of3")[0], _correct("dense")[0])
    assert round(100 * diff) == -8 and f"{100 * bound:.1f}" == "-13.9"
    assert "8 points below dense here (one-sided 95 % bound -13.9" in " ".join(_section().split())
