"""``condcomp bench decode`` told to stop (SIGTERM, what ``timeout`` sends at a time limit, as the prepared device
scripts use it): it writes what ran, marked stopped, and exits 124, instead of dying with nothing written. The
signal is sent from inside the run at a chosen call of the step clock, so the steps that ran are counted by hand."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import condcomp.bench.decode as decode
from condcomp.bench.stopping import Stopped, stop_on_sigterm
from condcomp.cli import main

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

ARGS = ["bench", "decode", "--model", "tiny-llama", "--quick", "--variants", "keep_0.25"]


def _terminate_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """SIGTERM to this process at the ``call``-th reading of the step clock (two readings per prefill or step)."""
    real = decode.device_clock
    calls = []

    def clock(device: torch.device) -> float:
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(device)

    monkeypatch.setattr(decode, "device_clock", clock)


@pytest.mark.slow
def test_a_run_stopped_while_decoding_writes_the_steps_that_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # readings 1-4: the two prefills; 5-8: step 1 (dense, keep); 9-10: step 2 of keep (the order rotates); the
    # 11th, dense's step 2 starting, is stopped: dense decoded 1 step, keep 2, paired on the first
    _terminate_at(monkeypatch, 11)
    assert main([*ARGS, "--out", str(tmp_path)]) == 124
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert "SIGTERM" in metrics["stopped"]
    by = {r["variant"]: r for r in metrics["records"]}
    assert list(by) == ["dense", "keep_0.25"] and all("SIGTERM" in r["stopped"] for r in by.values())
    assert by["dense"]["decode_ratio"] == 1.0 and by["keep_0.25"]["decode_ms_per_token"] > 0
    # the caches as the steps left them: dense 16 + 1 tokens of 8 heads, keep 16 + 2 tokens of 2 heads
    assert by["keep_0.25"]["kv_ratio"] == pytest.approx((18 * 2) / (17 * 8))
    assert "Stopped (stopped by SIGTERM" in (tmp_path / "table.md").read_text()
    assert "what ran is in" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the previous one again


@pytest.mark.slow
def test_a_run_stopped_before_any_step_writes_that_it_stopped(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _terminate_at(monkeypatch, 1)  # the first prefill
    assert main([*ARGS, "--out", str(tmp_path)]) == 124
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["records"] == [] and "SIGTERM" in metrics["stopped"]


def test_stop_on_sigterm_raises_stopped_inside_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match="SIGTERM"), stop_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes of the main thread
            pass
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_compiled_steps_run_without_cuda_graphs_are_counted_per_variant(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``graph_skips``: the compiled steps inductor ran without the CUDA graphs ``reduce-overhead`` asked for (its
    counter, bumped here by a stand-in for keep's compiled forward on each of its 3 decode steps)."""
    from torch._dynamo.utils import counters

    import condcomp.bench.decode_compiled as dc

    def compiled_steps(models: dict[str, torch.nn.Module], backend: str, mode: str | None) -> dict[str, Any]:
        def forward(name: str, model: torch.nn.Module) -> Any:
            def step(**kwargs: Any) -> Any:
                if name == "keep_0.25":
                    counters["inductor"]["cudagraph_skips"] += 1  # what inductor does when it cannot graph a step
                return model(**kwargs)
            return step
        return {name + dc.COMPILED: forward(name, model) for name, model in models.items()}

    monkeypatch.setattr(dc, "compiled_steps", compiled_steps)
    assert main([*ARGS, "--compile", "--compile-backend", "eager", "--out", str(tmp_path)]) == 0
    by = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert {name: r["graph_skips"] for name, r in by.items()} == {
        "dense": 0, "keep_0.25": 0, "dense+compiled": 0, "keep_0.25+compiled": 3}
    assert "Compiled without CUDA graphs" in (tmp_path / "table.md").read_text()
    assert "keep_0.25+compiled (16 x 2)" in (tmp_path / "table.md").read_text()
