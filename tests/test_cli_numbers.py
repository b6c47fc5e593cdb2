"""Every numeric option of every ``condcomp`` command is a finite number in its range, checked when the command line
is parsed: ``nan``, ``inf`` and out-of-range values are one line on stderr (exit status 2) naming the flag, before
any work starts (the functions that would do it are replaced by ones that fail the test if called).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from condcomp.cli import build_parser, main


def _refuse_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command started working before refusing its arguments")

    import condcomp.bench.compile
    import condcomp.bench.decode
    import condcomp.bench.kv
    import condcomp.experiments.classification.ablation
    import condcomp.experiments.classification.runner
    import condcomp.experiments.dit.study
    import condcomp.experiments.llm.calibrate_kv
    import condcomp.experiments.llm.tuning_study

    classification = condcomp.experiments.classification
    for module, name in [(classification.runner, "run_single"), (classification.runner, "eval_checkpoint"),
                         (classification.ablation, "run_ablation_study"),
                         (condcomp.experiments.llm.tuning_study, "run_tuning_study"),
                         (condcomp.experiments.llm.calibrate_kv, "run"), (condcomp.experiments.dit.study,
                                                                          "run_dit_study"),
                         (condcomp.bench.kv, "run"), (condcomp.bench.decode, "run"), (condcomp.bench.compile, "run")]:
        monkeypatch.setattr(module, name, started)


REFUSED = [
    (["calibrate-kv", "--lr", "inf"], "--lr", "not a finite number"),
    (["calibrate-kv", "--l1", "nan"], "--l1", "not a finite number"),
    (["calibrate-kv", "--l1", "inf"], "--l1", "not a finite number"),
    (["calibrate-kv", "--l1=-0.1"], "--l1", "out of range; pass a finite number >= 0"),
    (["calibrate-kv", "--method", "request", "--lr", "inf"], "--lr", "not a finite number"),
    (["calibrate-kv", "--fraction", "1.5"], "--fraction", "out of range"),
    (["calibrate-kv", "--window", "0"], "--window", "pass a whole number >= 1"),
    (["tune-llm", "--kl-temperature", "inf"], "--kl-temperature", "not a finite number"),
    (["tune-llm", "--lr", "inf"], "--lr", "not a finite number"),
    (["tune-llm", "--lr", "0"], "--lr", "out of range; pass a finite number > 0"),
    (["tune-llm", "--kl-weight", "2"], "--kl-weight", "out of range"),
    (["tune-llm", "--steps=-3"], "--steps", "pass a whole number >= 1"),
    (["train", "--budget-target", "nan"], "--budget-target", "not a finite number"),
    (["train", "--budget-cost=-inf"], "--budget-cost", "not a finite number"),
    (["train", "--lr", "nan"], "--lr", "not a finite number"),
    (["train", "--dropout", "1"], "--dropout", "out of range"),
    (["ablate", "--sweep-fractions", "0.5", "nan"], "--sweep-fractions", "not a finite number"),
    (["ablate", "--budget-costs", "inf"], "--budget-costs", "not a finite number"),
    (["demo", "--threads", "0"], "--threads", "pass a whole number >= 1"),
    (["dit", "--guidance", "inf"], "--guidance", "not a finite number"),
    (["dit", "--lr", "nan"], "--lr", "not a finite number"),
    (["bench", "kv", "--decode-batch", "0"], "--decode-batch", "pass a whole number >= 1"),
    (["bench", "decode", "--new-tokens", "0"], "--new-tokens", "pass a whole number >= 2"),
    (["bench", "compile", "--s", "nan"], "--s", "not a finite number"),
]


@pytest.mark.parametrize("argv,flag,words", REFUSED, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_non_finite_or_out_of_range_number_is_refused_when_parsed(
        argv: list[str], flag: str, words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    out = tmp_path / ("out.json" if argv[0] == "calibrate-kv" else "out")
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"argument {flag}: " in err and words in err, err
    assert not out.exists()


def _numeric_actions(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, str, object]]:
    """Every option of every (sub)command with its parse type."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _numeric_actions(sub, (*path, name))
        elif action.option_strings:
            found.append((" ".join(path), action.option_strings[-1], action.type))
    return found


def test_no_command_parses_a_number_with_plain_int_or_float() -> None:
    """``type=float`` accepts nan and inf, ``type=int`` any sign: every numeric option must say its range."""
    plain = [(cmd, flag) for cmd, flag, kind in _numeric_actions(build_parser()) if kind in (int, float)]
    assert plain == []


@pytest.mark.parametrize("argv,flag,value", [
    (["train", "--budget-target", "0.5", "--lr", "3e-4"], "budget_target", 0.5),
    (["calibrate-kv", "--l1", "0", "--out", "g.json"], "l1", 0.0),
    (["tune-llm", "--kl-weight", "1"], "kl_weight", 1.0),
    (["ablate", "--sweep-fractions", "1", "0.25", "--out", "o"], "sweep_fractions", [1.0, 0.25]),
])
def test_values_in_range_still_parse(argv: list[str], flag: str, value: object) -> None:
    if "--out" not in argv:
        argv = [*argv, "--out", "o"]
    assert getattr(build_parser().parse_args(argv), flag) == value


def test_a_config_file_holding_nan_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON config files may hold NaN (Python's json reads it): the run settings refuse it by name."""
    _refuse_work(monkeypatch)
    config = tmp_path / "run.json"
    config.write_text('{"budget_target": NaN, "method": "budgetformer"}')
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "budget_target must be a finite number, got nan" in err
