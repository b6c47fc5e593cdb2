"""``condcomp calibrate-kv`` end to end on the random tiny Llama (no download): both methods write a gates file in
one format that the split reads, and bad settings are refused with what to change."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from condcomp.cli import build_parser
from condcomp.experiments.llm.calibrate_kv import run
from condcomp.experiments.llm.duo_gates import load_gates, split_from_scores

pytest.importorskip("transformers")

TEXTS = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta"]) for _ in range(80))
         for i in range(30)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["duo", "importance"])
def test_both_methods_write_a_gates_file_the_split_reads(tmp_path: Path, method: str) -> None:
    out = tmp_path / "gates.json"
    args = build_parser().parse_args(["calibrate-kv", "--model", "tiny-llama", "--method", method, "--steps", "2",
                                      "--seq-len", "400", "--window", "60", "--out", str(out)])
    run(args, texts=TEXTS)
    record = load_gates(out, 4, 8)  # the tiny Llama: 4 layers, 8 key/value heads
    assert record["method"] == method and record["window"] == 60 and record["settings"]["steps"] == 2
    assert sum(len(k) for k in split_from_scores(record["scores"], 1 / 3)) == round(32 / 3)
    assert not out.with_suffix(".partial.pt").exists()  # the finished run leaves only the gates file
    if method == "duo":
        assert ((record["scores"] >= 0) & (record["scores"] <= 1)).all() and len(record["history"]) == 2


def test_a_sequence_no_longer_than_the_window_is_refused(tmp_path: Path) -> None:
    args = build_parser().parse_args(["calibrate-kv", "--model", "tiny-llama", "--seq-len", "256",
                                      "--out", str(tmp_path / "g.json")])
    with pytest.raises(ValueError, match="must exceed sinks \\+ window = 256"):
        run(args, texts=TEXTS)


def test_evaluate_screens_the_splits_against_dense(tmp_path: Path) -> None:
    import json

    import torch

    from condcomp.experiments.llm.duo_gates import save_gates

    gates = tmp_path / "all.json"
    save_gates(gates, "duo", "tiny-llama", torch.ones(4, 8), 4, 60, {})  # every group full: the dense model
    out = tmp_path / "screen.json"
    args = build_parser().parse_args(["calibrate-kv", "--model", "tiny-llama", "--evaluate", str(gates), "--fraction",
                                      "1", "--steps", "2", "--seq-len", "400", "--window", "60", "--out", str(out),
                                      "--importance", str(tmp_path / "absent.json")])
    run(args, texts=TEXTS)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"dense", "streaming (none full)", "all global 1"}
    full, streaming = results["all global 1"], results["streaming (none full)"]
    assert full["hidden_mse"] < 1e-10 and abs(full["ppl_ratio"] - 1.0) < 1e-5 and full["full_frac"] == 1.0
    assert full["answer_acc"] == results["dense"]["answer_acc"]
    assert streaming["hidden_mse"] > 0 and streaming["full_frac"] == 0.0


def test_evaluate_refuses_gates_trained_for_another_streaming_pattern(tmp_path: Path) -> None:
    """Red team round 5: a gates file was screened at --sinks/--window whatever it was trained for (a router file
    was refused)."""
    import torch

    from condcomp.experiments.llm.duo_gates import save_gates

    gates = tmp_path / "g.json"
    save_gates(gates, "duo", "tiny-llama", torch.ones(4, 8), 4, 60, {})
    args = build_parser().parse_args(["calibrate-kv", "--model", "tiny-llama", "--evaluate", str(gates), "--steps",
                                      "1", "--seq-len", "400", "--window", "61", "--out", str(tmp_path / "s.json"),
                                      "--importance", str(tmp_path / "absent.json")])
    with pytest.raises(ValueError, match="trained for 4 \\+ 60 streamed tokens, the screen streams 4 \\+ 61: "
                                         "screen it with --sinks 4 --window 60"):
        run(args, texts=TEXTS)


@pytest.mark.slow
def test_request_method_trains_a_router_file_and_the_screen_reads_it(tmp_path: Path) -> None:
    import json

    import torch

    from condcomp.experiments.llm.request_split import load_router

    importance = tmp_path / "importance.json"
    importance.write_text(json.dumps({"group_importance": torch.rand(4, 8).tolist()}))
    out = tmp_path / "router.pt"
    common = ["--model", "tiny-llama", "--method", "request", "--steps", "2", "--seq-len", "400", "--window", "60",
              "--importance", str(importance)]
    args = build_parser().parse_args(["calibrate-kv", *common, "--out", str(out)])
    run(args, texts=TEXTS)
    assert not out.with_suffix(".partial.pt").exists()
    record = torch.load(out, weights_only=True)
    assert record["settings"]["lr"] == 1e-3 and record["settings"]["init"] == "importance"
    assert record["window"] == 60 and len(record["history"]) == 2
    screen = tmp_path / "screen.json"
    args = build_parser().parse_args(["calibrate-kv", *common, "--evaluate", str(out), "--out", str(screen)])
    run(args, texts=TEXTS)
    results = json.loads(screen.read_text())["results"]
    request = results["router per request"]
    assert request["full_frac"] == 1 / 8 and len(request["choices"]) == 2  # 2 rows x 4 layers x 1 group
    assert 0.0 <= request["differs_from_static"] <= 1.0 and "importance per layer, 3 of 8" in results
    model = __import__("condcomp.bench.kv", fromlist=["load"]).load("tiny-llama")[0]
    assert len(load_router(out, model).routers) == 4


def test_mix_is_refused_with_the_request_method(tmp_path: Path) -> None:
    args = build_parser().parse_args(["calibrate-kv", "--model", "tiny-llama", "--method", "request", "--mix",
                                      "--out", str(tmp_path / "r.pt")])
    with pytest.raises(ValueError, match="--mix calibrates DuoAttention gates"):
        run(args, texts=TEXTS)


@pytest.mark.slow
def test_mix_trains_gates_that_record_their_rows_and_screens_them(tmp_path: Path) -> None:
    import json

    rng = random.Random(5)
    texts = [" ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(6)) for _ in range(60))
             for _ in range(30)]  # varied enough that a quoted passage occurs once
    out = tmp_path / "mix.json"
    common = ["--model", "tiny-llama", "--mix", "--steps", "3", "--seq-len", "400", "--window", "60"]
    run(build_parser().parse_args(["calibrate-kv", *common, "--out", str(out)]), texts=texts)
    record = load_gates(out, 4, 8)
    assert record["settings"]["rows"] == "mix" and record["settings"]["steps"] == 3
    screen = tmp_path / "screen.json"
    run(build_parser().parse_args(["calibrate-kv", *common, "--evaluate", str(out), "--out", str(screen),
                                   "--importance", str(tmp_path / "absent.json")]), texts=texts)
    results = json.loads(screen.read_text())
    assert results["rows"] == 3 and set(results["results"]) == {"dense", "streaming (none full)", "mix global 0.333"}
