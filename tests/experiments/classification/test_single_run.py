"""The experiments runner end to end on the tiny preset: train, checkpoint, resume, eval, report, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors", reason="checkpoints need safetensors (extra 'experiments')")

from condcomp.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from condcomp.cli import main  # noqa: E402
from condcomp.experiments.classification.model import EncoderClassifier, ModelConfig  # noqa: E402
from condcomp.experiments.classification.runconfig import RunConfig  # noqa: E402
from condcomp.experiments.classification.runner import eval_checkpoint, run_single  # noqa: E402
from condcomp.experiments.classification.train import build_model  # noqa: E402

TINY = {"dataset": "synthetic", "preset": "tiny", "synthetic_train": 96, "synthetic_test": 40, "synthetic_len": 16,
        "max_len": 16, "batch_size": 16, "latency_reps": 1, "eval_batch_size": 64, "threads": 1}


def tiny(**kw: object) -> RunConfig:
    return RunConfig.from_dict({**TINY, **kw})


@pytest.mark.slow
def test_resume_continues_exactly_where_the_run_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Oracle: one uninterrupted 8-step run. Interrupted: the same run killed after its step-4 checkpoint, resumed.
    cfg = tiny(method="budgetformer", max_steps=8, checkpoint_every=4)
    straight, _ = run_single(cfg, tmp_path / "straight")
    import condcomp.experiments.classification.train as train_mod

    real = train_mod.condcomp.set_progress

    def killed_at_step_5(model: torch.nn.Module, p: float) -> None:
        if p == 4 / 8:
            raise KeyboardInterrupt("simulated kill")
        real(model, p)

    monkeypatch.setattr(train_mod.condcomp, "set_progress", killed_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        run_single(cfg, tmp_path / "resumed")
    monkeypatch.setattr(train_mod.condcomp, "set_progress", real)
    torch.manual_seed(123)  # a different global state: resume must restore the saved one
    resumed, model = run_single(cfg, tmp_path / "resumed", resume=True)
    assert resumed["train"]["step"] == 8
    ref = build_model(ModelConfig.from_dict(straight["model"]), cfg)
    load_checkpoint(tmp_path / "straight" / "checkpoint", ref)
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert resumed["accuracy"] == straight["accuracy"]


def test_eval_of_a_checkpoint_matches_the_training_run(tmp_path: Path) -> None:
    trained, _ = run_single(tiny(method="fixed", method_options={"fraction": 0.5}, max_steps=5), tmp_path / "run")
    again = eval_checkpoint(tmp_path / "run" / "checkpoint", tmp_path / "eval")
    assert again["accuracy"] == trained["accuracy"]
    assert again["k_frac"] == pytest.approx(0.5)  # 2 of 4 heads for every example
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["checkpoint"].endswith("checkpoint")


def test_corrupt_checkpoint_names_the_file(tmp_path: Path) -> None:
    run_single(tiny(method="standard", max_steps=2), tmp_path / "run")
    weights = tmp_path / "run" / "checkpoint" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        eval_checkpoint(tmp_path / "run" / "checkpoint", tmp_path / "eval")


def test_mismatched_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    run_single(tiny(method="standard", max_steps=2), tmp_path / "run")
    other = EncoderClassifier(ModelConfig(vocab_size=13, num_classes=4, d_model=32, num_heads=4, d_ff=64,
                                          num_layers=2, max_len=16))
    import condcomp

    condcomp.apply_(other, condcomp.CondCompConfig(policy="full", router="random"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "run" / "checkpoint", other)
    assert "model.safetensors" in str(err.value) and "layers.1.attn.q_proj.weight" in str(err.value)


def test_cli_train_eval_report_on_files_with_bad_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tokenizers", reason="text data needs tokenizers (extra 'experiments')")
    rows = [{"body": f"{w} story number {i}", "y": int(w == "sports")} for i in range(40)
            for w in ("sports", "market")]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken json\n" + json.dumps({"body": "x"}) + "\n")
    test = tmp_path / "test.csv"
    test.write_text("body,y\n" + "".join(f"{w} item {i},{int(w == 'sports')}\n" for i in range(10)
                                         for w in ("sports", "market")))
    args = ["train", "--dataset", "files", "--train-file", str(train), "--test-file", str(test), "--text-field",
            "body", "--label-field", "y", "--tokenizer", "trained", "--preset", "tiny", "--max-len", "16",
            "--max-steps", "3", "--latency-reps", "1", "--method", "budgetformer", "--threads", "1"]
    assert main(args + ["--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert f"{train}:81" in err and "--skip-bad-rows" in err  # the broken line, and what to do
    assert main(args + ["--skip-bad-rows", "--out", str(tmp_path / "run")]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["data"]["skipped_rows"] == {"train": 2, "test": 0}
    assert metrics["data"]["train_rows"] == 80
    assert main(["eval", str(tmp_path / "run" / "checkpoint"), "--out", str(tmp_path / "ev")]) == 0
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["accuracy"] == metrics["accuracy"]
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run"), str(tmp_path / "ev"), "--out", str(tmp_path / "rep"),
                 "--no-plots"]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| run/budgetformer |" in text and "| ev/budgetformer |" in text
    assert f"| {metrics['accuracy']:.4f} | {metrics['s_mean']:.3f} |" in text


def test_cli_resume_without_checkpoint_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--dataset", "synthetic", "--preset", "tiny", "--out", str(tmp_path), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_config_file_and_flags(tmp_path: Path) -> None:
    from condcomp.cli import build_parser
    from condcomp.experiments.classification.commands import run_config

    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps({"dataset": "imdb", "lr": 0.01, "max_steps": 7}))
    args = build_parser().parse_args(["train", "--config", str(cfg_file), "--lr", "0.002", "--out", "x"])
    cfg = run_config(args)
    assert (cfg.dataset, cfg.lr, cfg.max_steps) == ("imdb", 0.002, 7)
    cfg_file.write_text(json.dumps({"learning_rate": 1}))
    with pytest.raises(ValueError, match="learning_rate"):
        run_config(build_parser().parse_args(["train", "--config", str(cfg_file), "--out", "x"]))


def test_ablation_reuses_finished_arms_only_with_the_same_settings(tmp_path: Path) -> None:
    from condcomp.experiments.classification.seed_study import SeedStudy

    cfg = tiny(max_steps=2)
    first = SeedStudy(cfg, tmp_path).train("standard", "standard")
    again = SeedStudy(cfg, tmp_path).train("standard", "standard")  # reused: same numbers, no retraining
    assert again["accuracy"] == first["accuracy"] and again["wall_seconds"] == first["wall_seconds"]
    with pytest.raises(ValueError, match="lr"):
        SeedStudy(tiny(max_steps=2, lr=0.5), tmp_path).train("standard", "standard")
