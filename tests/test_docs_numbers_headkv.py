"""docs/kv-frontier.md's per-group budgets screen: every count and byte fraction it quotes equals the committed
records of results/kv_headkv_screen, recomputed by that folder's table.py (which reads the records, not condcomp's
code)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUOTED = re.compile(r"`([\w.-]+)` \((\d\.\d{3})x\) (\d+)")
ROW = re.compile(r"^\| (after the context|aware) \| `([\w.-]+)` \| (\d\.\d{3}) \| (\d+) of 20 \|")


def computed_rows() -> dict[tuple[str, str], tuple[str, int]]:
    pytest.importorskip("scipy")
    spec = importlib.util.spec_from_file_location("headkv_table", ROOT / "results" / "kv_headkv_screen" / "table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = {}
    for line in module.main().splitlines():
        m = ROW.match(line)
        if m:
            rows[(m[1], m[2])] = (m[3], int(m[4]))
    return rows


def test_the_screen_numbers_on_the_frontier_page_are_the_records() -> None:
    rows = computed_rows()
    text = " ".join((ROOT / "docs" / "kv-frontier.md").read_text().split())
    section = text[text.index("## Per-group budgets (HeadKV)"):]
    quoted = 0
    for label, start in (("after the context", "After the context: "), ("aware", "Question-aware: ")):
        sentence = section[section.index(start):].split(". ")[0]
        dense = re.search(r"dense (\d+) of 20", sentence)
        assert dense is not None and int(dense[1]) == rows[(label, "dense")][1], sentence
        for name, frac, found in QUOTED.findall(sentence):
            assert rows[(label, name)] == (frac, int(found)), (label, name)
            quoted += 1
    assert quoted >= 6  # both budgets of headkv and both splits, in at least one mode each
    assert (ROOT / "results" / "kv_headkv_screen" / "table.md").read_text() == computed_table()


def computed_table() -> str:
    spec = importlib.util.spec_from_file_location("headkv_table", ROOT / "results" / "kv_headkv_screen" / "table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.main())
