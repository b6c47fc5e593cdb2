"""``executor="auto"`` (dense where nothing is worth skipping, gathered otherwise) and the attention benchmark."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from core_helpers import leaf_plan, make_layout, make_weights
from test_gathered import moh_active, seq_active

import condcomp
from condcomp.bench_attention import add_arguments, main, paired_ratio
from condcomp.executors.auto import explain, get_executor, resolve_executor
from condcomp.executors.gathered import CPU, GatheredExecutor, gather_sizes
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs


def test_auto_runs_dense_at_full_budget_and_gathered_below() -> None:
    """At toy sizes (the size rule lifted by the pool's tuning): dense attention at full budget, gathered below;
    the dense-work bound of the tuning is where the choice flips."""
    toy = replace(CPU, min_skipped_work_sequence=0, min_skipped_work_token=0)
    pool = [GatheredExecutor(tuning=toy), get_executor("masked"), get_executor("reference")]
    w = make_weights(make_layout(H=8, Dh=4, D=32))
    x = torch.randn(4, 6, 32, dtype=torch.float64)
    full = condcomp.full_plan(4, 8, x.device)
    assert resolve_executor("auto", w, AttentionInputs(x=x), full, pool).name == "masked"
    sparse, _ = leaf_plan(seq_active([1, 2, 3, 2], 8))
    chosen = resolve_executor("auto", w, AttentionInputs(x=x), sparse, pool)
    assert chosen.name == "gathered"
    want = get_executor("reference")(w, AttentionInputs(x=x), sparse)
    torch.testing.assert_close(chosen(w, AttentionInputs(x=x), sparse), want, atol=1e-10, rtol=1e-9)
    token, _ = leaf_plan(moh_active(4, 6, 8, 1, 1))
    assert resolve_executor("auto", w, AttentionInputs(x=x), token, pool).name == "gathered"
    assert toy.prefers_dense(1.0, "token") and not toy.prefers_dense(0.25, "sequence")
    bound = toy.dense_work_sequence
    assert toy.prefers_dense(bound, "sequence") and not toy.prefers_dense(bound - 0.01, "sequence")


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_auto_runs_dense_when_the_call_is_too_small_to_pay(granularity: str) -> None:
    """Same plan shape, two sizes: where ``(1 - kept share) * B*T*D`` is below ``MIN_SKIPPED_WORK`` auto runs
    masked, above it gathered; the bound sits between the two."""
    H, D = 8, 64
    w = make_weights(make_layout(H=H, Dh=D // H, D=D), torch.float32)
    picked, skipped = {}, {}
    for T in (4, 1024):
        x = torch.randn(8, T, D)
        if granularity == "sequence":
            plan, _ = leaf_plan(seq_active([2] * 8, H))
        else:
            plan, _ = leaf_plan(moh_active(8, T, H, 1, 1))
        share = gather_sizes(w, AttentionInputs(x=x), plan).work_fraction
        skipped[T] = (1 - share) * x.numel()
        picked[T] = resolve_executor("auto", w, AttentionInputs(x=x), plan).name
    bound = CPU.min_skipped_work_token if granularity == "token" else CPU.min_skipped_work_sequence
    assert skipped[4] < bound <= skipped[1024]
    assert picked == {4: "masked", 1024: "gathered"}
    assert CPU.prefers_dense(0.25, granularity, size=None) is False  # no size given: the share alone decides


def test_a_third_party_executor_competes_on_cost_and_explain_says_why(restore_registries: None) -> None:
    """An executor that declares capabilities and a cost below everyone else's runs under auto; one whose
    capabilities exclude the call is rejected with the capability named; ``explain`` lists every verdict and the
    gathered executor's routes."""
    w = make_weights(make_layout(H=8, Dh=8, D=64), torch.float32)
    x = torch.randn(8, 256, 64)
    plan, _ = leaf_plan(seq_active([2, 1, 3, 2, 1, 2, 2, 1], 8))
    choice = explain(w, AttentionInputs(x=x), plan)
    assert choice.executor == "gathered" and choice.route == "sequence.grouped"
    assert dict(choice.routes)["sequence.shared_set"] == ["the examples chose different head sets"]
    assert "masked: cost 1.00" in str(choice) and "route sequence.buckets: can run" in str(choice)

    @register_executor("cheap")
    class Cheap:
        name = "cheap"
        capabilities = Capabilities(granularities=("sequence",), devices=("cpu",))

        def supports(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return None

        def estimate(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return Estimate(0.01, note="made up")

        def __call__(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return get_executor("reference")(weights, inputs, plan)

    assert resolve_executor("auto", w, AttentionInputs(x=x), plan).name == "cheap"
    token, _ = leaf_plan(moh_active(8, 256, 8, 1, 1))
    choice = explain(w, AttentionInputs(x=x), token)
    assert choice.executor == "masked" and "cheap: cannot run: granularity 'token'" in str(choice)


def test_head_usage_names_the_executor_and_route() -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.25}), router="random", executor="gathered")
    layer = condcomp.RoutedAttention.wrap(condcomp.HeadAttention(64, 8), cfg)
    layer(torch.randn(4, 64, 64))
    usage = layer.head_usage()
    assert usage is not None and usage.executor == "gathered"
    assert usage.route in {"sequence.one_bucket", "sequence.grouped"}


def test_auto_skips_executors_that_reject_and_lists_reasons(restore_registries: None) -> None:
    w = make_weights(make_layout(H=4, Dh=4, D=16), torch.float32)
    x = torch.randn(2, 3, 16, dtype=torch.float64)  # dtype mismatch: gathered names it and declines
    plan, _ = leaf_plan(seq_active([1, 2], 4))
    assert resolve_executor("auto", w, AttentionInputs(x=x), plan).name == "masked"

    @register_executor("never")
    class Never:
        name = "never"
        granularities = ("sequence",)

        def supports(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return "never runs anything"

        def __call__(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            raise AssertionError

    with pytest.raises(RuntimeError, match="never runs anything"):
        resolve_executor("never", w, AttentionInputs(x=x), plan)


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
    """``benchmarks/<name>.py`` as a module (the scripts are not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepared_gpu_script_checks_pass_on_cpu() -> None:
    """benchmarks/gpu_check.py is run once, on a lent GPU, with no chance to debug it there: its correctness part
    (gathered vs reference, float32 and bfloat16, eight situations) must already run and pass on CPU."""
    gpu_check = load_benchmark_script("gpu_check")
    results = gpu_check.checks(torch.device("cpu"))
    assert len(results) == 2 * len(gpu_check.CASES) * 7 and "token_per_head" in gpu_check.CASES
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]


def fake_torch_scatter(correct: bool) -> types.ModuleType:
    """A stand-in for torch-scatter (not installed here: it compiles for minutes): ``scatter`` adds with
    ``index_add_`` when ``correct``, else returns the destination untouched."""
    module = types.ModuleType("torch_scatter")

    def scatter(src: torch.Tensor, index: torch.Tensor, dim: int, out: torch.Tensor, reduce: str) -> torch.Tensor:
        assert dim == 0 and reduce == "sum"
        return out.index_add_(0, index, src) if correct else out

    module.scatter = scatter  # type: ignore[attr-defined]
    return module


def test_scatter_benchmark_checks_every_variant_before_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/scatter.py: without torch-scatter it says how to get it; with it, every case times all four
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
