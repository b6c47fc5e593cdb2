"""The files ``calibrate-kv`` and ``bench kv`` are given: an existing folder as ``--out``, and a file of another kind
(a KV gates file, a router file, other JSON) as ``--importance``, are one line on stderr (exit status 2) that names
what the file is and which kind is accepted, before any model is loaded. A static_importance.json is accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from condcomp.cli import build_parser, main


def _refuse_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command started working before refusing its arguments")

    import condcomp.bench.kv
    import condcomp.experiments.llm.calibrate_kv

    monkeypatch.setattr(condcomp.experiments.llm.calibrate_kv, "run", started)
    monkeypatch.setattr(condcomp.bench.kv, "run", started)


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("method", ["duo", "importance", "request"])
def test_calibrate_kv_out_that_is_a_folder_is_refused(method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    err = _one_line_error(["calibrate-kv", "--model", "tiny-llama", "--method", method, "--out", str(tmp_path)],
                          capsys)
    assert f"argument --out: {tmp_path} is a folder; pass the path of a file to write" in err


def _gates_file(path: Path) -> Path:
    from condcomp.experiments.llm.duo_gates import save_gates

    save_gates(path, "duo", "tiny-llama", torch.rand(4, 8), 4, 60, {})
    return path


def _router_file(path: Path) -> Path:
    torch.save({"format": "condcomp-kv-request-router/1", "scorers": []}, path)
    return path


TINY = ["--model", "tiny-llama"]
COMMANDS = {"calibrate-kv request": ["calibrate-kv", *TINY, "--method", "request", "--out", "{out}"],
            "calibrate-kv evaluate": ["calibrate-kv", *TINY, "--evaluate", "g.json", "--out", "{out}"],
            "bench kv": ["bench", "kv", *TINY, "--out", "{dir}"]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("kind,make,says", [
    ("gates", _gates_file, "is a KV gates file (method 'duo', written by condcomp calibrate-kv)"),
    ("router", _router_file, "is a torch file (a per-request router file"),
    ("other json", lambda p: (p.write_text('{"scores": [1, 2]}'), p)[1], "holds a JSON object with keys ['scores']"),
    ("not json", lambda p: (p.write_text("scores: 1"), p)[1], "is not a JSON file"),
])
def test_importance_of_another_kind_is_named(command: str, kind: str, make: object, says: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _refuse_work(monkeypatch)
    given = make(tmp_path / "given.json")  # type: ignore[operator]
    argv = [a.format(out=tmp_path / "out.json", dir=tmp_path / "bench") for a in COMMANDS[command]]
    err = _one_line_error([*argv, "--importance", str(given)], capsys)
    assert f"argument --importance: {given} {says}" in err, err
    assert "--importance takes static pruning's group importance: the static_importance.json that condcomp " \
           "tune-llm writes" in err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_static_importance_file_or_none_is_accepted(command: str, tmp_path: Path) -> None:
    importance = tmp_path / "static_importance.json"
    importance.write_text(json.dumps({"group_importance": torch.rand(4, 8).tolist()}))
    argv = [a.format(out=tmp_path / "out.json", dir=tmp_path / "bench") for a in COMMANDS[command]]
    assert build_parser().parse_args([*argv, "--importance", str(importance)]).importance == importance
    absent = tmp_path / "absent.json"  # computed (bench kv) or reported missing later, as before
    assert build_parser().parse_args([*argv, "--importance", str(absent)]).importance == absent
