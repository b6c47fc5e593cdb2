"""The benchmarks (``condcomp bench attention``, ``scatter``, ``gpu-check``): they run, write their records, and
check their answers before timing. No timing is asserted."""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch

from condcomp.bench.attention import add_arguments, main, paired_ratio


def test_bench_attention_quick_writes_metrics(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--quick", "--reps", "1", "--passes", "both", "--out", str(tmp_path)])
    assert main(args) == 0
    records = json.loads((tmp_path / "metrics.json").read_text())
    variants = {r["variant"] for r in records}
    assert variants == {"dense", "oracle", "masked", "gathered"}
    assert {r["pass"] for r in records} == {"fwd", "fwd+bwd"}
    assert {r["granularity"] for r in records} == {"sequence", "token"}
    for r in records:
        assert set(r["shape"]) == {"B", "T", "D", "H"} and r["ms"] > 0
        assert isinstance(r["minor_faults"], (int, float)) and r["minor_faults"] >= 0
        assert {"omp_wait_policy", "malloc_trim_threshold", "malloc_mmap_threshold"} <= set(r)
        assert len(r["ms_reps"]) == 1 and r["ms"] == r["ms_reps"][0]
        if r["variant"] == "dense":
            assert r["paired_to_dense"] == 1.0
    text = (tmp_path / "table.md").read_text()
    assert "gathered/oracle" in text and "paired g/o" in text and "page faults d/o/m/g" in text
    assert len(text.splitlines()) == 2 + len(records) // 4  # one row per (shape, granularity, pass, s)


def test_paired_ratio_pairs_repetitions() -> None:
    """The machine slows down threefold in the second repetition. Per repetition the variant takes 2, 2 and
    2.2 times the base (paired median 2); the medians of the two lists, taken apart, compare the variant's third
    repetition with the base's first and give 2.2."""
    times, base = [2.0, 6.0, 2.2], [1.0, 3.0, 1.0]
    assert paired_ratio(times, base) == 2.0
    assert statistics.median(times) / statistics.median(base) == 2.2
    assert paired_ratio([2.0, 4.0, 8.0], [1.0, 1.0, 1.0]) == 4.0  # the median ratio, not the mean (14 / 3)


def load_benchmark_script(name: str) -> types.ModuleType:
    """``condcomp.bench.<name>``, the module behind ``condcomp bench <name>``."""
    return importlib.import_module(f"condcomp.bench.{name}")


@pytest.mark.slow
def test_prepared_gpu_script_checks_pass_on_cpu() -> None:
    """``condcomp bench gpu-check`` is run once, on a lent GPU, with no chance to debug it there: its correctness part
    (gathered vs reference, float32 and bfloat16, eight situations) must already run and pass on CPU."""
    gpu_check = load_benchmark_script("gpu_check")
    results = gpu_check.checks(torch.device("cpu"))
    compared = [r for r in results if r["ok"] is not None]
    # every case and dtype compared at least one strategy's output and six gradients with the reference
    assert {(r["case"], r["dtype"]) for r in compared} == {
        (c, d) for c in gpu_check.CASES for d in ("torch.float32", "torch.bfloat16")}
    assert len(compared) % 7 == 0 and {"token.per_head", "token.by_set", "sequence.buckets"} <= {
        r["strategy"] for r in compared}
    assert all(r["ok"] for r in compared), [r for r in compared if not r["ok"]]


def fake_torch_scatter(correct: bool) -> types.ModuleType:
    """A stand-in for torch-scatter (not installed here: it compiles for minutes): ``scatter`` adds with
    ``index_add_`` when ``correct``, else returns the destination untouched."""
    module = types.ModuleType("torch_scatter")

    def scatter(src: torch.Tensor, index: torch.Tensor, dim: int, out: torch.Tensor, reduce: str) -> torch.Tensor:
        assert dim == 0 and reduce == "sum"
        return out.index_add_(0, index, src) if correct else out

    module.scatter = scatter  # type: ignore[attr-defined]
    return module


@pytest.mark.slow
def test_scatter_benchmark_checks_every_variant_before_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``condcomp bench scatter``: without torch-scatter it says how to get it; with it, every case times all four
    variants and writes them; a variant that disagrees with the float64 reference stops the run."""
    scatter_bench = load_benchmark_script("scatter")
    monkeypatch.setitem(sys.modules, "torch_scatter", None)  # None in sys.modules: the import fails
    monkeypatch.setattr(sys, "argv", ["scatter.py", "--out", str(tmp_path), "--reps", "1", "--rounds", "1"])
    assert scatter_bench.main() == 2 and "pip install --no-build-isolation torch-scatter" in capsys.readouterr().err

    monkeypatch.setitem(sys.modules, "torch_scatter", fake_torch_scatter(correct=True))
    assert scatter_bench.main() == 0
    records = json.loads((tmp_path / "metrics.json").read_text())
    assert {(r["case"], r["variant"]) for r in records} == {
        (case[0], v) for case in scatter_bench.cases(torch.Generator().manual_seed(0))
        for v in ("index_add_", "scatter_add_", "torch_scatter.scatter", "clone")}
    assert all(len(r["ms"]) == 1 and r["ms"][0] > 0 for r in records)

    monkeypatch.setitem(sys.modules, "torch_scatter", fake_torch_scatter(correct=False))
    with pytest.raises(AssertionError, match="torch_scatter.scatter disagrees"):
        scatter_bench.run(reps=1, rounds=1)


@pytest.mark.slow
def test_condcomp_bench_scatter_runs_the_same_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line reaches the module's benchmark: every case and variant written to --out."""
    from condcomp.cli import main as condcomp_main

    monkeypatch.setitem(sys.modules, "torch_scatter", fake_torch_scatter(correct=True))
    assert condcomp_main(["bench", "scatter", "--out", str(tmp_path), "--reps", "1", "--rounds", "1",
                          "--threads", "1"]) == 0
    records = json.loads((tmp_path / "metrics.json").read_text())
    cases = load_benchmark_script("scatter").cases(torch.Generator().manual_seed(0))
    assert len(records) == 4 * len(cases) and all(r["threads"] == 1 for r in records)
