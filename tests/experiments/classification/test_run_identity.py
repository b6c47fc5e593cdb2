"""A run's settings are part of its identity: ``condcomp ablate`` neither reuses nor combines runs made with
other settings, and says so before anything trains, naming the runs and how to start fresh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from condcomp.cli import main
from condcomp.experiments.classification import ablation as ablation_module
from condcomp.experiments.classification.ablation_stats import statistics
from condcomp.experiments.classification.runconfig import RunConfig, changed_settings, identity_differences

FLAGS = ["--dataset", "synthetic", "--preset", "tiny", "--max-steps", "3"]


class Trained(Exception):
    """Raised by a stand-in SeedStudy: the command got past its checks and would train."""


def _finished(out: Path, arm: str, **settings: object) -> Path:
    """A finished run folder of seed 0 as ablate writes it, with these settings."""
    d = out / "synthetic" / "seed0" / arm
    d.mkdir(parents=True)
    cfg = RunConfig.from_dict({"dataset": "synthetic", "preset": "tiny", "max_steps": 3, "test_seed": 1,
                               "method": arm, **settings})
    (d / "metrics.json").write_text(json.dumps({"config": cfg.to_dict()}))
    return d


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise Trained

    monkeypatch.setattr(ablation_module, "SeedStudy", refuse)


def test_other_settings_are_refused_before_anything_trains(tmp_path: Path, no_training: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    other = _finished(tmp_path, "standard", max_steps=40, max_train=500)
    assert main(["ablate", *FLAGS, "--out", str(tmp_path), "--seeds", "0", "1"]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "max_steps 40 there, 3 now" in err and "max_train 500 there, None now" in err
    assert "another --out" in err


def test_settings_outside_the_identity_do_not_block_reuse(tmp_path: Path, no_training: None) -> None:
    _finished(tmp_path, "standard", threads=4, checkpoint_every=10)
    _finished(tmp_path, "budgetformer_cost0.3", budget_cost=0.3)  # that arm sets its own price on heads
    with pytest.raises(Trained):
        main(["ablate", *FLAGS, "--out", str(tmp_path), "--seeds", "0", "--threads", "1"])


def test_summary_records_of_other_settings_are_refused_too(tmp_path: Path, no_training: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "res" / "summary.json"
    summary.parent.mkdir()
    record = {"dataset": "synthetic", "arm": "moh", "seed": 0, "run_dir": str(tmp_path / "gone"),
              "setup": {"max_steps": 3, "max_len": 64}}
    summary.write_text(json.dumps([record]))
    assert main(["ablate", *FLAGS, "--out", str(tmp_path / "runs"), "--summary", str(summary)]) == 2
    err = capsys.readouterr().err
    assert "gone: max_len 64 there, 128 now" in err and "--summary" in err


def test_identity_differences_by_hand() -> None:
    want = {"max_steps": 3, "seed": 0, "threads": 1, "lr": 0.001}
    assert identity_differences(want, {"max_steps": 5, "seed": 1, "threads": 2}, varies=("seed",)) == [
        "max_steps 5 there, 3 now"]  # threads: not identity; seed: allowed to vary; lr: absent from the record
    assert identity_differences(want, dict(want)) == []


def test_paired_statistics_over_different_test_sets_name_the_runs(tmp_path: Path) -> None:
    records = []
    for seed, n in ((0, 4), (1, 6)):
        for arm in ("budgetformer", "fixed_matched"):
            d = tmp_path / f"seed{seed}" / arm
            d.mkdir(parents=True)
            (d / "examples.json").write_text(json.dumps({"correct": [True] * n}))
            records.append({"dataset": "synthetic", "arm": arm, "seed": seed, "run_dir": str(d), "heads": 0.5,
                            "accuracy": 1.0})
    with pytest.raises(ValueError, match="different test sets") as err:
        statistics(records)
    assert str(tmp_path / "seed1" / "fixed_matched") in str(err.value) and "fresh --out" in str(err.value)


def test_a_field_added_after_a_run_counts_as_its_default() -> None:
    """A run saved before a setting existed ran with that setting's default: reusing it at the default is the
    same run; asking for another value is a change; a changed old field still is."""
    saved = RunConfig(dataset="synthetic").to_dict()
    del saved["budget_target"]  # a run folder written before --budget-target existed
    assert changed_settings(saved, RunConfig(dataset="synthetic")) == []
    assert changed_settings(saved, RunConfig(dataset="synthetic", budget_target=2.0)) == ["budget_target"]
    assert changed_settings(saved, RunConfig(dataset="synthetic", lr=0.5, budget_target=2.0)) == [
        "budget_target", "lr"]
