"""``condcomp bench decode --quick`` on the tiny random Llama: every variant timed and written, the full budget's
greedy tokens equal the dense model's (reference: the dense model's own tokens), the KV cache measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from condcomp.cli import main

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")


def test_quick_decode_benchmark_writes_every_variant(tmp_path: Path) -> None:
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "metrics.json").read_text())["records"]
    by = {r["variant"]: r for r in records}
    assert list(by) == ["dense", "full", "keep_0.50", "keep_0.25"]
    assert by["dense"]["tokens_equal_dense"] and by["full"]["tokens_equal_dense"]
    # (B=2) x (prompt 16 + 3 decoded tokens) x 4 layers x 8 KV heads x 64 dims x (K and V) x 4 bytes
    assert by["dense"]["kv_bytes"] == 2 * 19 * 4 * 8 * 64 * 2 * 4 and by["full"]["kv_ratio"] == 1.0
    # per-request plans cache the kept KV heads only: 4 and 2 of 8 (both rows keep the same number)
    assert by["keep_0.50"]["kv_ratio"] == 0.5 and by["keep_0.25"]["kv_ratio"] == 0.25
    assert (tmp_path / "table.md").read_text().startswith("| prompt |")
