"""The convergence signal: ``PlateauCheck`` against window means computed by hand, and ``condcomp train`` warning on
a run that is too short, with what to change, and recording the verdict in metrics.json and the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from condcomp.cli import main
from condcomp.experiments.classification.convergence import PlateauCheck, warning


def test_the_last_window_is_compared_with_the_one_before_it() -> None:
    losses = [3.0] * 50 + [2.0] * 20 + [1.0] * 20 + [0.9] * 10  # 100 steps: windows of 20 (a fifth)
    v = PlateauCheck().verdict(losses)
    assert v["window_steps"] == 20
    assert v["earlier_loss"] == pytest.approx((2.0 * 10 + 1.0 * 10) / 20)  # steps 60-79
    assert v["last_loss"] == pytest.approx((1.0 * 10 + 0.9 * 10) / 20)  # steps 80-99
    assert v["plateaued"] is False and v["relative_drop"] == pytest.approx((1.5 - 0.95) / 1.5)


def test_a_flat_noisy_or_near_zero_loss_counts_as_a_plateau() -> None:
    check = PlateauCheck()
    assert check.verdict([1.0] * 100)["plateaued"] is True
    noisy = check.verdict([0.5, 1.5] * 40 + [0.45, 1.45] * 10)  # a drop of 0.05 in batch noise of sd 0.5
    assert (noisy["earlier_loss"], noisy["last_loss"]) == (pytest.approx(1.0), pytest.approx(0.95))
    assert noisy["plateaued"] is True  # 2 standard errors: 2 * sqrt((0.25 + 0.25) / 20) = 0.32 > 0.05
    near_zero = check.verdict([0.014] * 80 + [0.006] * 20)
    assert near_zero["relative_drop"] == pytest.approx(0.008 / 0.014)  # 57 % relative, 0.008 absolute
    assert near_zero["plateaued"] is True  # below absolute_tolerance (0.05)
    assert PlateauCheck(absolute_tolerance=0.0).verdict([0.02] * 80 + [0.0] * 20)["plateaued"] is False


def test_too_few_steps_cannot_tell() -> None:
    v = PlateauCheck().verdict([2.0 - 0.1 * i for i in range(19)])  # two windows of 10 need 20 steps
    assert v["plateaued"] is None
    message = warning(v, 0.5, "fixed")
    assert message is not None and "19 training steps are too few" in message and "--epochs" in message
    assert warning(PlateauCheck().verdict([1.0] * 40), 3, "fixed") is None


def test_train_warns_when_too_short_and_records_the_verdict(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "--dataset", "synthetic", "--synthetic-train", "96", "--synthetic-test", "40",
            "--synthetic-len", "16", "--preset", "tiny", "--method", "fixed", "--max-steps", "6", "--batch-size",
            "16", "--latency-reps", "1", "--threads", "1", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "warning: fixed: 6 training steps are too few to tell" in err and "raise --epochs" in err
    train = json.loads((tmp_path / "run" / "metrics.json").read_text())["train"]
    assert train["convergence"]["plateaued"] is None and train["convergence"]["steps"] == 6
    assert "loss_history" not in train  # the per-step losses stay in the checkpoint, for --resume
    from condcomp.checkpoint import read_checkpoint_config

    assert read_checkpoint_config(tmp_path / "run" / "checkpoint") is not None


def test_a_resumed_run_judges_every_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "--dataset", "synthetic", "--synthetic-train", "96", "--synthetic-test", "40",
            "--synthetic-len", "16", "--preset", "tiny", "--method", "standard", "--batch-size", "16", "--epochs", "10",
            "--latency-reps", "1", "--threads", "1", "--out", str(tmp_path / "run")]
    import condcomp.experiments.classification.train as train_module

    real_step, calls = train_module._train_step, []

    def interrupted_after_12(*args: object, **kwargs: object) -> float:
        calls.append(1)
        if len(calls) > 12:  # as a Ctrl-C after the step-12 checkpoint
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)  # type: ignore[arg-type]

    run = [*base, "--max-steps", "24", "--checkpoint-every", "4"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_module, "_train_step", interrupted_after_12)
        with pytest.raises(KeyboardInterrupt):
            main(run)
    assert main([*run, "--resume"]) == 0
    conv = json.loads((tmp_path / "run" / "metrics.json").read_text())["train"]["convergence"]
    assert conv["steps"] == 24  # 12 before the resume + 12 after, not only the last 12
