"""``executor="auto"`` (dense where nothing is worth skipping, gathered otherwise) and the attention benchmark."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch
from core_helpers import leaf_plan, make_layout, make_weights
from test_gathered import moh_active, seq_active

import condcomp
from condcomp.bench_attention import add_arguments, main, paired_ratio
from condcomp.executors import auto
from condcomp.executors.auto import get_executor, resolve_executor
from condcomp.executors.gathered import gather_sizes
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs


def test_auto_runs_dense_at_full_budget_and_gathered_below(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "MIN_SKIPPED_WORK", {})  # toy sizes: the size rule is tested below
    w = make_weights(make_layout(H=8, Dh=4, D=32))
    x = torch.randn(4, 6, 32, dtype=torch.float64)
    full = condcomp.full_plan(4, 8, x.device)
    assert resolve_executor("auto", w, AttentionInputs(x=x), full).name == "masked"
    sparse, _ = leaf_plan(seq_active([1, 2, 3, 2], 8))
    chosen = resolve_executor("auto", w, AttentionInputs(x=x), sparse)
    assert chosen.name == "gathered"
    want = get_executor("reference")(w, AttentionInputs(x=x), sparse)
    torch.testing.assert_close(chosen(w, AttentionInputs(x=x), sparse), want, atol=1e-10, rtol=1e-9)
    token, _ = leaf_plan(moh_active(4, 6, 8, 1, 1))
    assert resolve_executor("auto", w, AttentionInputs(x=x), token).name == "gathered"
    assert auto.prefer_dense(1.0, "token") and not auto.prefer_dense(0.25, "sequence")
    inference, training = auto.DENSE_WORK_FRACTION["sequence"]
    for bound, train in ((inference, False), (training, True)):
        assert auto.prefer_dense(bound, "sequence", train) and not auto.prefer_dense(bound - 0.01, "sequence", train)


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
    assert skipped[4] < auto.MIN_SKIPPED_WORK[granularity] <= skipped[1024]
    assert picked == {4: "masked", 1024: "gathered"}
    assert auto.prefer_dense(0.25, granularity, size=None) is False  # no size given: the share alone decides


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


def test_prepared_gpu_script_checks_pass_on_cpu() -> None:
    """benchmarks/gpu_check.py is run once, on a lent GPU, with no chance to debug it there: its correctness part
    (gathered vs reference, float32 and bfloat16, eight situations) must already run and pass on CPU."""
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", script)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    results = gpu_check.checks(torch.device("cpu"))
    assert len(results) == 2 * len(gpu_check.CASES) * 7 and "token_per_head" in gpu_check.CASES
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
