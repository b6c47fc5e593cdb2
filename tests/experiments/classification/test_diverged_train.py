"""``condcomp train`` whose loss goes non-finite (a finite but huge --lr) stops at that step: exit status 2, a message
naming the step and the learning rate, no metrics.json, and no checkpoint of non-finite parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from condcomp.cli import main


def test_a_diverged_training_run_writes_no_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = main(["train", "--dataset", "synthetic", "--preset", "tiny", "--synthetic-train", "64",
                 "--synthetic-test", "32", "--max-steps", "4", "--batch-size", "16", "--lr", "1e30",
                 "--latency-reps", "1", "--threads", "1", "--checkpoint-every", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "condcomp train: error: training diverged at step " in err and "--lr 1e+30" in err, err
    assert "--budget-cost" not in err  # a term switched off is not named
    assert not (out / "metrics.json").exists()
    # the check runs before a step's checkpoint is saved: the one written holds finite parameters only
    from safetensors.torch import load_file

    saved = load_file(out / "checkpoint" / "model.safetensors")
    assert saved and all(bool(t.isfinite().all()) for t in saved.values())
