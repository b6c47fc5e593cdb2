"""The command line checks what its flags name before it works: an output path that is a file, a results folder
with no results, a config file that is not a JSON object. Each is one line on stderr, exit status 2, and nothing
(no data, model or benchmark) is loaded first: the functions that would do the work are replaced by ones that fail
the test if called.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from condcomp.cli import main


def _refuse_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command started working before refusing its arguments")

    import condcomp.bench.attention
    import condcomp.bench.compile
    import condcomp.bench.decode
    import condcomp.bench.gpu_check
    import condcomp.bench.scatter
    import condcomp.experiments.classification.ablation
    import condcomp.experiments.classification.demo
    import condcomp.experiments.classification.runner
    import condcomp.experiments.llm.tuning_study

    classification = condcomp.experiments.classification
    for module, name in [(classification.runner, "run_single"), (classification.runner, "eval_checkpoint"),
                         (classification.ablation, "run_ablation_study"), (classification.demo, "run_demo"),
                         (condcomp.experiments.llm.tuning_study, "run_tuning_study"),
                         (condcomp.experiments.llm.tuning_study, "write_summary"),
                         (condcomp.bench.decode, "run"), (condcomp.bench.attention, "run"),
                         (condcomp.bench.compile, "run"), (condcomp.bench.scatter, "run"),
                         (condcomp.bench.gpu_check, "run"), (condcomp.bench.gpu_check, "checks")]:
        monkeypatch.setattr(module, name, started)


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv", [
    ["demo", "--out", "{file}"],
    ["train", "--dataset", "synthetic", "--out", "{file}"],
    ["eval", "{dir}", "--out", "{file}"],
    ["ablate", "--dataset", "synthetic", "--out", "{file}"],
    ["report", "{dir}", "--out", "{file}"],
    ["tune-llm", "--out", "{file}"],
    ["tune-llm", "--out", "{dir}", "--results", "{file}"],
    ["bench", "attention", "--out", "{file}"],
    ["bench", "compile", "--out", "{file}"],
    ["bench", "scatter", "--out", "{file}"],
    ["bench", "gpu-check", "--out", "{file}"],
    ["bench", "decode", "--model", "tiny-llama", "--quick", "--out", "{file}"],
    ["bench", "decode", "--model", "tiny-llama", "--quick", "--out", "{file}/sub"],
], ids=lambda argv: " ".join(a for a in argv if not a.startswith("{")))
def test_an_output_folder_that_is_a_file_is_refused_before_any_work(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    existing = tmp_path / "existing.json"
    existing.write_text("{}")
    err = _one_line_error([a.format(file=existing, dir=tmp_path) for a in argv], capsys)
    assert str(existing) in err and "is a file" in err.replace("an existing file", "is a file"), err
    assert existing.read_text() == "{}"


@pytest.mark.parametrize("flag", ["--summary", "--doc"])
def test_an_output_file_that_is_a_folder_is_refused(flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    argv = (["ablate", "--dataset", "synthetic", "--out", str(tmp_path / "runs"), "--summary", str(tmp_path)]
            if flag == "--summary" else ["report", str(tmp_path), "--doc", str(tmp_path)])
    err = _one_line_error(argv, capsys)
    assert f"argument {flag}: {tmp_path} is a folder" in err


@pytest.mark.parametrize("content,kind", [("[1, 2]", "a list"), ("3", "a number"), ('"ag_news"', "a string")])
@pytest.mark.parametrize("command", ["train", "ablate"])
def test_a_config_that_is_not_a_json_object_is_one_line(command: str, content: str, kind: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    config = tmp_path / "run.json"
    config.write_text(content)
    err = _one_line_error([command, "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert f"argument --config: {config} holds {kind}; it must be a JSON object" in err
    assert not (tmp_path / "out").exists()


def test_inline_json_options_that_are_not_an_object_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    err = _one_line_error(["train", "--method-options", "[0.25]", "--out", str(tmp_path)], capsys)
    assert "argument --method-options" in err and "holds a list" in err
    err = _one_line_error(["ablate", "--moh", "{bad", "--out", str(tmp_path)], capsys)
    assert "argument --moh" in err and "not valid JSON" in err


def test_report_only_on_a_folder_without_results_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    empty = tmp_path / "results"
    empty.mkdir()
    code = main(["tune-llm", "--report-only", "--results", str(empty), "--out", str(tmp_path / "absent")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"--report-only: no tune-llm results in {tmp_path / 'absent'}, {empty}" in err
    assert list(empty.iterdir()) == []  # no empty summary table written


@pytest.mark.parametrize("argv, match", [
    (["bench", "compile", "--quick", "--executors", "gathered", "nope"], "unknown executor 'nope'; pass registered"),
    (["bench", "compile", "--quick", "--executors"], "expected at least one argument"),
])
def test_bench_compile_refuses_an_unknown_executor_before_timing_dense(argv: list[str], match: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # it built and timed the dense model first, then failed on the name (an empty --executors ran every executor)
    _refuse_work(monkeypatch)
    err = _one_line_error([*argv, "--out", str(tmp_path / "out")], capsys)
    assert "argument --executors" in err and match in err, err
    assert not (tmp_path / "out").exists()


def test_bench_compile_leaves_the_decoders_kv_cache_executor_out_and_refuses_it_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # its row timed, on an encoder stack without a cache, a cache-free path auto never runs
    import condcomp
    from condcomp.bench.compile import POLICIES, default_executors, variants

    registered = condcomp.list_executors()
    assert "kv_cache" in registered and default_executors() == [n for n in registered if n != "kv_cache"]
    rows = variants()
    assert rows[0] == ("dense", "fixed") and ("kv_cache", "fixed") not in rows
    assert rows == [("dense", "fixed"), *((n, "fixed") for n in registered if n != "kv_cache"),
                    *(("gathered", p) for p in POLICIES[1:])]
    with pytest.raises(ValueError, match="reads a decoder's KV cache"):
        variants(["masked", "kv_cache"])
    _refuse_work(monkeypatch)
    err = _one_line_error(["bench", "compile", "--quick", "--executors", "kv_cache", "--out", str(tmp_path / "o")],
                          capsys)
    assert "argument --executors" in err and "reads a decoder's KV cache" in err, err
    assert "condcomp bench decode --compile" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, match", [
    (["bench", "decode", "--model", "tiny-llama", "--quick", "--compile", "--compile-backend", "nonsense"],
     "argument --compile-backend: unknown torch.compile backend 'nonsense'; pass one of"),
    (["bench", "gpu-check", "--device", "cpu", "--quick", "--compile-backend", "indcutor"],
     "argument --compile-backend: unknown torch.compile backend 'indcutor'"),
    (["bench", "decode", "--model", "tiny-llama", "--quick", "--compile", "--compile-mode", "fast"],
     "argument --compile-mode: invalid choice: 'fast'"),
])
def test_a_compile_backend_or_mode_torch_does_not_know_is_refused_when_parsed(
        argv: list[str], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # bench decode loaded the model and decoded eagerly before torch.compile refused the backend; gpu-check on a
    # CPU never compiles (--compile auto), so a misspelt backend went unnoticed until the GPU run
    _refuse_work(monkeypatch)
    err = _one_line_error([*argv, "--out", str(tmp_path / "out")], capsys)
    assert match in err, err


def test_bench_decode_refuses_new_tokens_that_leave_no_decode_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # --new-tokens 1 (the prefill's token only) timed no decode step and wrote an empty table with exit 0
    from condcomp.bench.decode import run

    _refuse_work(monkeypatch)
    err = _one_line_error(["bench", "decode", "--model", "tiny-llama", "--new-tokens", "1", "--out",
                           str(tmp_path / "out")], capsys)
    assert "argument --new-tokens: 1 is out of range" in err and ">= 2" in err, err
    with pytest.raises(ValueError, match="new_tokens=1: the first token comes from the prefill"):
        run("tiny-llama", new_tokens=1)
    assert not (tmp_path / "out").exists()


def test_bench_decode_says_which_sizes_quick_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # --quick replaced --prompts 512 with prompt 16 and said nothing
    import condcomp.bench.decode

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(condcomp.bench.decode, "run", lambda *a, **kw: calls.append(kw) or [])
    argv = ["bench", "decode", "--model", "tiny-llama", "--quick", "--prompts", "512", "--reps", "2"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "--quick runs prompt 16, batch 2, 4 tokens, 1 repetition: --prompts --reps ignored" in err, err
    assert calls[-1]["prompts"] == (16,) and calls[-1]["reps"] == 1
    assert main(["bench", "decode", "--model", "tiny-llama", "--quick", "--out", str(tmp_path / "b")]) == 0
    assert "ignored" not in capsys.readouterr().err  # --quick alone: nothing replaced


def test_bench_decode_refuses_a_compile_backend_without_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # without --compile every variant decoded eagerly, and the run said nothing of the backend it was given
    _refuse_work(monkeypatch)
    argv = ["bench", "decode", "--model", "tiny-llama", "--quick", "--compile-backend", "eager"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--compile-backend eager is the backend of the compiled runs" in err and "add it" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, match", [
    (["--compile", "--compile-backend", "eager"], "--compile-backend eager ignores it"),
    ([], "nothing is compiled without --compile"),
])
def test_bench_decode_refuses_a_compile_mode_nothing_reads(extra: list[str], match: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # torch.compile passes a mode to the eager backend, which ignores it: the record said a mode that never applied
    _refuse_work(monkeypatch)
    argv = ["bench", "decode", "--model", "tiny-llama", "--quick", "--compile-mode", "max-autotune", *extra]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--compile-mode max-autotune is a mode of torch.compile's inductor backend" in err and match in err, err
    assert not (tmp_path / "out").exists()
