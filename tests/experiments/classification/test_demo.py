"""``condcomp demo --quick`` end to end (the full demo is timed by hand, see docs/demo.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from condcomp.cli import main


@pytest.mark.slow
def test_demo_quick_writes_table_metrics_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("safetensors", reason="the demo's checkpoints need safetensors (extra 'experiments')")
    assert main(["demo", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| standard |" in out and "| budgetformer |" in out and "| fixed_topk |" in out and "| moh |" in out
    assert "Hard examples received more heads than easy ones:" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["rows"]) == {"standard", "budgetformer", "fixed_topk", "moh"}
    assert metrics["rows"]["standard"]["k_frac"] == 1.0 and metrics["rows"]["standard"]["speedup_b64"] == 1.0
    assert set(metrics["difficulty"]) == {"easy", "hard"}
    # fixed top-k runs the smallest head count >= BudgetFormer's realised mean
    H = metrics["model"]["num_heads"]
    assert metrics["rows"]["fixed_topk"]["k_frac"] >= metrics["rows"]["budgetformer"]["k_frac"] - 1e-9
    assert metrics["rows"]["fixed_topk"]["k_frac"] * H == round(metrics["rows"]["fixed_topk"]["k_frac"] * H)
    pytest.importorskip("matplotlib", reason="plots need matplotlib (extra 'report')")
    assert (tmp_path / "budget_by_difficulty.png").stat().st_size > 0
    assert (tmp_path / "layer_usage.png").stat().st_size > 0
