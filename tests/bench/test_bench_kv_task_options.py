"""``bench kv``'s retrieval flags that one task reads are refused by name with the other task, never ignored; so are
the decode timing's sizes when ``--time-decode`` names nothing to time.

Before: ``--passkey-format chat`` with the facts task (the default), where no passkey prompt is built, was accepted
and ignored, also on a tokenizer with no chat template. The oracle is the table below, written from what each task
builds (:func:`condcomp.bench.kv_cases.retrieval_cases`: the passkey task reads the format, the facts task the
fact count, question form and question placement), not from the code's own table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from condcomp import cli
from condcomp.bench.kv_presets import refuse_other_task_options

READS = {"passkey": {"passkey_format"}, "facts": {"facts", "question_form", "question_in_context", "question_aware"}}
FLAGS = {"passkey_format": "--passkey-format", "facts": "--facts", "question_form": "--question-form",
         "question_in_context": "--question-in-context", "question_aware": "--question-aware"}


@pytest.mark.parametrize("task", ["facts", "passkey"])
@pytest.mark.parametrize("field", sorted(FLAGS))
def test_a_flag_is_refused_exactly_when_the_task_does_not_read_it(task: str, field: str) -> None:
    if field in READS[task]:
        refuse_other_task_options(task, [field])
        return
    with pytest.raises(ValueError, match=rf"{FLAGS[field]}: only the \w+ task reads it, and this run's task is {task}"):
        refuse_other_task_options(task, [field])


def refused_before_the_run(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> str:
    """``condcomp bench kv ARGV`` exits 2 before its run starts (a started run fails the test); its stderr."""
    import condcomp.bench.kv as bench_kv

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(bench_kv, "run", no_run)
    assert cli.main(["bench", "kv", "--model", "tiny-llama", "--out", str(tmp_path / "out"), *argv]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--passkey-format", "chat"], "--passkey-format"),  # the default task is facts
    (["--task", "facts", "--passkey-format", "raw"], "--passkey-format"),
    (["--task", "passkey", "--facts", "3"], "--facts"),
    (["--task", "passkey", "--question-in-context"], "--question-in-context"),
    (["--task", "quotes", "--question-aware"], "--question-aware"),
])
def test_the_command_refuses_them_before_any_model_is_loaded(argv: list[str], flag: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    err = refused_before_the_run(argv, tmp_path, capsys, monkeypatch)
    assert f"{flag}: only the" in err and "--task" in err


@pytest.mark.parametrize("argv, named", [(["--time-decode", "--decode-batch", "4"], "--decode-batch"),
                                         (["--decode-prompt", "64", "--time-decode"], "--decode-prompt")])
def test_decode_timing_sizes_are_refused_when_nothing_is_timed(argv: list[str], named: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    err = refused_before_the_run(argv, tmp_path, capsys, monkeypatch)
    assert f"{named} size the decode timing, and --time-decode without names times nothing" in err


def test_chat_on_a_tokenizer_without_a_template_is_refused_with_the_passkey_task(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "kv", "--model", "tiny-llama", "--out", str(tmp_path / "out"), "--task", "passkey",
            "--passkey-format", "chat", "--builtin-text", "--variants", "dense", "--prompts", "64"]
    assert cli.main(argv) == 2
    assert "passkey format 'chat' needs a tokenizer with a chat template" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("**/*.json"))
