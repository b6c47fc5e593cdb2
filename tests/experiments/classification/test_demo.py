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


def test_the_demo_table_carries_each_arms_convergence_verdict() -> None:
    """The loss-flat column and the note under the table follow PlateauCheck's verdict on each arm's loss; the
    window means in the note are recomputed here with numpy."""
    np = pytest.importorskip("numpy")
    from condcomp.experiments.classification.convergence import PlateauCheck
    from condcomp.experiments.classification.demo import loss_flat, not_converged_note

    falling = [2.0 - 0.01 * i for i in range(100)]  # 100 steps, still falling by 0.2 per 20 steps
    flat = [1.0, 1.1] * 50
    check = PlateauCheck()
    rows = {"standard": {"convergence": check.verdict(flat)}, "fixed_topk": {"convergence": check.verdict(falling)},
            "moh": {"convergence": check.verdict(flat[:15])}}
    for row in rows.values():
        row["loss_flat"] = loss_flat(row["convergence"])
    assert [r["loss_flat"] for r in rows.values()] == ["yes", "no", "too short"]
    assert loss_flat(None) == "not recorded"
    note = not_converged_note(rows)
    assert note is not None and "standard" not in note
    earlier, last = np.mean(falling[60:80]), np.mean(falling[80:])
    assert f"fixed_topk (still falling: {earlier:.3f} -> {last:.3f})" in note
    assert "moh (15 steps, too few to tell)" in note
    assert not_converged_note({"standard": rows["standard"]}) is None
