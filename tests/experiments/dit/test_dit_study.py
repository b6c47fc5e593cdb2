"""The DiT study end to end at a toy size: records, the matched fixed arm, resuming, plots and the CLI entry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sklearn", reason="the DiT study trains on scikit-learn's digits (extra 'vision')")

import torch  # noqa: E402

from condcomp.experiments.dit import classifier, study  # noqa: E402
from condcomp.experiments.dit.train import DiTRunSettings  # noqa: E402

TOY = {"model": {"d_model": 40, "num_layers": 1, "freq_dim": 16}, "steps": 2, "batch_size": 8,
       "samples_per_class": 2, "sample_steps": 1}


@pytest.fixture
def quick_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    real = classifier.train_judge
    monkeypatch.setattr(classifier, "train_judge", lambda images, labels: real(images, labels, steps=3))


@pytest.mark.slow
def test_study_writes_records_matches_the_fixed_arm_and_resumes(tmp_path: Path, quick_judge: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    settings = DiTRunSettings.from_dict(TOY)
    summary = study.run_dit_study(tmp_path, [0], ["fixed", "dense", "budgetformer_cond"], settings, "condcomp dit")
    assert list(summary["statistics"]) == ["dense", "budgetformer_cond", "fixed"]
    records = {r["variant"]: r for r in summary["records"]}
    assert records["dense"]["heads"] == 1.0 and records["dense"]["flop_fraction"] == 1.0
    learned = json.loads((tmp_path / "seed0" / "budgetformer_cond" / "metrics.json").read_text())
    assert records["fixed"]["fraction"] == max(1, round(learned["heads"] * 20)) / 20
    assert records["fixed"]["heads"] == pytest.approx(records["fixed"]["fraction"])
    assert summary["learned_minus_fixed"]["pairs"] == 1
    prof = summary["noise_profiles"]["budgetformer_cond"]
    assert prof["t"] == [1.0] and list(prof["layers"]) == ["blocks.0.attn"]
    for key in ("frechet", "class_accuracy", "sampling_seconds"):
        assert isinstance(records["budgetformer_cond"][key], float)

    def no_training(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(study, "run_one", no_training)
    again = study.run_dit_study(tmp_path, [0], ["dense", "budgetformer_cond", "fixed"], settings)
    assert again["records"] == summary["records"]
    with pytest.raises(ValueError, match="other settings"):
        study.run_dit_study(tmp_path, [0], ["dense"], DiTRunSettings.from_dict({**TOY, "steps": 3}))


def test_study_refuses_unknown_or_unmatched_variants(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="unknown DiT variants"):
        study.ordered(["dense", "moh_80"])
    with pytest.raises(ValueError, match="matched"):
        study.ordered(["dense", "fixed"])


def test_cli_runs_the_study_and_draws_the_plots(tmp_path: Path, quick_judge: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (extra 'report')")
    from condcomp.cli import main

    rc = main(["dit", "--out", str(tmp_path), "--seeds", "0", "--variants", "dense", "moh_50", "--steps", "2",
               "--batch-size", "8", "--samples-per-class", "2", "--sample-steps", "1", "--model",
               json.dumps(TOY["model"])])
    assert rc == 0
    for name in ("plots/samples.png", "plots/heads_vs_noise.png", "plots/quality_vs_heads.png", "summary.md"):
        assert (tmp_path / name).is_file(), name
    table = (tmp_path / "summary.md").read_text()
    assert "| MoH 50 % | 1 |" in table and "| dense | 1 |" in table
    assert main(["dit", "--out", str(tmp_path / "none"), "--plots-only"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_npz_image_set_runs_with_a_conv_judge_and_wrong_shapes_are_named(tmp_path: Path,
                                                                            quick_judge: None) -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    arrays = {"train_images": rng.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8),
              "train_labels": np.arange(40) % 10,
              "test_images": rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8), "test_labels": np.arange(20) % 10}
    np.savez(tmp_path / "set.npz", **arrays)
    settings = DiTRunSettings.from_dict({**TOY, "model": {**TOY["model"], "channels": 3}})
    summary = study.run_dit_study(tmp_path / "out", [0], ["dense"], settings, data_file=tmp_path / "set.npz")
    assert summary["judge"]["kind"] == "ConvJudge"
    assert summary["records"][0]["num_samples"] == 20
    with pytest.raises(ValueError, match=r"expects \(1, 8, 8\)"):
        study.run_dit_study(tmp_path / "out2", [0], ["dense"], DiTRunSettings.from_dict(TOY),
                        data_file=tmp_path / "set.npz")
    np.savez(tmp_path / "bad.npz", train_images=arrays["train_images"])
    with pytest.raises(ValueError, match="missing arrays"):
        study.run_dit_study(tmp_path / "out3", [0], ["dense"], settings, data_file=tmp_path / "bad.npz")


def test_the_table_gives_sampling_time_as_a_range_over_seeds_never_an_interval_below_zero() -> None:
    from condcomp.experiments.dit.plots import markdown_table

    times = [1.0, 9.0, 2.0]  # a loaded machine: a t-interval over these three reaches below 0
    stat = {"n": 3, "mean": 4.0, "sd": 4.36, "lo": -6.8, "hi": 14.8}
    summary = {"statistics": {"dense": {m: stat for m in ("frechet", "class_accuracy", "heads", "flop_fraction",
                                                         "sampling_seconds")}},
               "records": [{"variant": "dense", "seed": s, "sampling_seconds": t} for s, t in enumerate(times)]}
    row = next(line for line in markdown_table(summary).splitlines() if line.startswith("| dense |"))
    assert row.endswith("| 4.0 (1.0-9.0) |")


def test_sample_tiles_put_each_digit_at_its_class_row_and_sample_column_with_gaps_between() -> None:
    from condcomp.experiments.dit.plots import sample_tiles

    grid = torch.rand(10, 3, 4, 4) * 2 - 1  # (class, sample, S, S)
    tiles = sample_tiles(grid, gap=1)
    assert tiles.shape == (10 * 5 - 1, 3 * 5 - 1)
    for c in range(10):
        for j in range(3):  # digit (c, j) at rows 5c..5c+3, columns 5j..5j+3, untouched
            assert torch.equal(tiles[5 * c:5 * c + 4, 5 * j:5 * j + 4], grid[c, j])
    keep = torch.tensor([r % 5 == 4 for r in range(tiles.shape[0])])[:, None] | \
        torch.tensor([q % 5 == 4 for q in range(tiles.shape[1])])[None, :]
    assert bool(tiles[keep].isnan().all()) and not bool(tiles[~keep].isnan().any())


def test_the_sample_figure_draws_square_pixels(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from condcomp.experiments.dit.plots import draw_sample_grids

    seen = []
    real_imshow = plt.Axes.imshow

    def imshow(ax: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("aspect"))
        return real_imshow(ax, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Axes, "imshow", imshow)
        assert draw_sample_grids([("dense", torch.zeros(10, 8, 8, 8)), ("fixed", torch.zeros(10, 8, 8, 8))],
                                 tmp_path / "s.png")
    assert seen == ["equal", "equal"] and (tmp_path / "s.png").stat().st_size > 0
