"""``condcomp bench gpu-check``: run once on a lent GPU with no chance to debug it there, so everything but the GPU
is exercised here: the cells and their priority, the whole run on CPU (``--device cpu --quick``) with the fields its
records must hold, and the time budget stopping a run cleanly. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import condcomp.bench.gpu_check as gpu_check
from condcomp.bench.gpu_cells import COMPILED, cells
from condcomp.cli import main as condcomp_main
from condcomp.executors.gathered import STRATEGIES

QUICK = ["bench", "gpu-check", "--device", "cpu", "--quick", "--reps", "1"]
BIG, SMALL = (8, 2048, 2048, 32), (64, 512, 768, 12)


def test_cells_cover_the_issue_grid_with_the_target_rows_first() -> None:
    every = cells(quick=False, compile_cells="targets")
    grid = {(c.shape, c.granularity, c.s, c.dtype) for c in every}
    assert len(every) == len(grid) == 2 * 2 * 4 * 2
    assert grid == {(sh, g, s, d) for sh in (BIG, SMALL) for g in ("sequence", "token")
                    for s in (0.125, 0.25, 0.5, 1.0) for d in ("bfloat16", "float32")}
    # issue 47's targets, in its table's order (its two B=8 s=0.25 rows are one cell: both passes are timed)
    assert [(c.shape, c.granularity, c.s, c.dtype) for c in every[:4]] == [
        (BIG, "sequence", 0.25, "bfloat16"), (BIG, "sequence", 1.0, "bfloat16"),
        (SMALL, "sequence", 0.25, "bfloat16"), (BIG, "token", 0.5, "bfloat16")]
    dtypes = [c.dtype for c in every]
    assert dtypes == sorted(dtypes)  # every bfloat16 cell before any float32 one
    assert [c.compile for c in every] == [True] * 4 + [False] * 28
    assert not any(c.compile for c in cells(compile_cells="off"))
    assert all(c.compile for c in cells(compile_cells="all"))


def test_a_cells_time_is_estimated_from_finished_cells_with_compiling_apart() -> None:
    first, *rest = cells(quick=False, compile_cells="targets")
    big_bf16 = next(c for c in rest if c.shape == BIG and c.dtype == "bfloat16" and not c.compile)
    big_fp32 = next(c for c in rest if c.shape == BIG and c.dtype == "float32")
    small_compiled = next(c for c in rest if c.shape == SMALL and c.compile)
    done = [(first, 100.0, 90.0)]  # 10 s of timing, 90 s of compiling
    assert gpu_check._estimate(big_bf16, done, quick=False) == 10.0
    assert gpu_check._estimate(big_fp32, done, quick=False) == 20.0  # no float32 cell yet: twice the shape's
    assert gpu_check._estimate(small_compiled, done, quick=False) == 30.0 + 90.0  # first guess + a compile
    assert gpu_check._estimate(first, [], quick=False) == 30.0 + 90.0


def test_cuda_asked_for_on_a_machine_without_it_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert condcomp_main(["bench", "gpu-check", "--out", str(tmp_path)]) == 2
    assert "--device cpu" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_the_full_grid_on_a_cpu_is_refused_and_names_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # --device cpu without --quick ran the GPU grid's checks and cells on the CPU: hours
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("gpu-check started the grid before refusing --device cpu without --quick")

    monkeypatch.setattr(gpu_check, "checks", started)
    monkeypatch.setattr(gpu_check, "run", started)
    assert condcomp_main(["bench", "gpu-check", "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--device cpu without --quick" in err and "add --quick" in err, err
    assert not (tmp_path / "out").exists()


def _strict_load(path: Path) -> Any:
    """``json.loads`` as strict readers (jq, JavaScript) parse: ``Infinity`` and ``NaN`` are errors."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{path.name} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_the_records_are_strict_json_when_gathered_never_wins(tmp_path: Path) -> None:
    """Cells where gathered is always slower than masked fit the threshold "never gathered" (``inf``): tuning.json
    wrote it as ``Infinity``, which strict JSON readers refuse. It is written as the string ``"inf"`` now, and the
    CUDA fields a person copies stay finite numbers."""
    records = []
    for s, pas in [(s, p) for s in (0.25, 1.0) for p in ("fwd", "fwd+bwd")]:
        for variant, ratio in (("dense", 1.0), ("floor", s), ("masked", 1.1), ("gathered", 2.0)):
            records.append({"shape": {"B": 2, "T": 16, "D": 64, "H": 8}, "granularity": "sequence", "s": s, "k": 2,
                            "dtype": "bfloat16", "variant": variant, "pass": pas, "target_cell": False,
                            "strategy": "sequence.static" if variant == "gathered" else None, "ms": ratio,
                            "paired_to_dense": ratio, "paired_to_floor": ratio / s, "rel_err_vs_masked": None})
    header = {"command": "condcomp bench gpu-check", "commit": "abc", "device": "GPU", "torch": torch.__version__,
              "cuda": "12", "started_utc": "now", "cells_total": 2, "not_started": [], "stopped": None,
              "nan_field": float("nan")}
    gpu_check.write(tmp_path, header, records, [], 1.0)
    tuning = _strict_load(tmp_path / "tuning.json")
    assert tuning["fits"]["sequence"]["min_skipped_work"] == "inf"  # never gathered: float("inf") reads it back
    assert tuning["fields"]["min_skipped_work_sequence"] == 2**40 and tuning["fields"]["measured"] is True
    assert _strict_load(tmp_path / "metrics.json")["nan_field"] == "nan"
    gpu_check.write_checks(tmp_path, header, [{"case": "seq", "rel_err": float("inf"), "ok": False}])
    assert _strict_load(tmp_path / "checks.json")["checks"][0]["rel_err"] == "inf"


def test_a_cpu_dry_run_under_the_interpreter_checks_the_triton_strategies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRITON_INTERPRET=1 condcomp bench gpu-check --device cpu --quick`` listed sequence.triton and token.triton
    as "CUDA only": the dry run never checked the strategies the GPU run checks first. Under the interpreter they run
    (float32 through the kernels); without it they still say why not."""
    from condcomp.bench.gpu_cells import every_strategy_tuning
    from condcomp.executors.gathered import GatheredExecutor, pairs

    cpu = torch.device("cpu")
    for name, strategy in (("seq", "sequence.triton"), ("token", "token.triton")):
        w, inputs, plan, _ = gpu_check.case(name, torch.float32, cpu, quick=True)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        why = dict(GatheredExecutor(tuning=every_strategy_tuning(cpu)).explain(w, inputs, plan))[strategy]
        assert why and "CUDA only" in why[0]
        if pairs.triton_available():
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            assert every_strategy_tuning(cpu).pair_kernels_on_cpu
            assert dict(GatheredExecutor(tuning=every_strategy_tuning(cpu)).explain(w, inputs, plan))[strategy] == []
    assert not every_strategy_tuning(torch.device("cuda")).pair_kernels_on_cpu  # CUDA runs them anyway


def test_the_gpu_runs_checks_leave_partial_kernel_tiles() -> None:
    """The checks are the only run of the Triton kernels on a GPU before their timings: at T = 64 and Dh = 32 every
    tile of the pair kernels was full, so no masked edge of a compiled kernel was ever checked there. Their sizes
    now leave partial row tiles (T not a multiple of 64), a head width that is not a power of two (partial output
    and reduction tiles) and partial blocks of keys."""
    pytest.importorskip("triton")
    from condcomp.executors.gathered.pairs.launch import COLS, REDUCE, ROWS

    B, T, D, H, Dh = gpu_check.CHECK_SIZES[False]
    assert T % ROWS and T > ROWS and Dh & (Dh - 1) and Dh % COLS and Dh % REDUCE and D == H * Dh
    w, inputs, plan, _ = gpu_check.case("seq", torch.float32, torch.device("cpu"))
    assert inputs.x.shape == (B, T, D) and w.layout.head_dim == Dh


def _strategies(granularity: str) -> set[str]:
    return {s.name for s in STRATEGIES[granularity]}


@pytest.mark.slow
def test_quick_cpu_run_writes_checks_timings_and_table(tmp_path: Path) -> None:
    assert condcomp_main([*QUICK, "--compile", "targets", "--compile-backend", "eager", "--profile", "all",
                          "--out", str(tmp_path)]) == 0

    checks = json.loads((tmp_path / "checks.json").read_text())
    assert {"command", "commit", "device", "torch"} <= set(checks) and checks["all_ok"] is True
    assert "--device cpu" in checks["command"] and checks["commit"]
    for case in gpu_check.CASES:  # every strategy of the table either compared with the reference or said why not
        for dtype in ("torch.float32", "torch.bfloat16"):
            rows = [r for r in checks["checks"] if r["case"] == case and r["dtype"] == dtype]
            ran = {r["strategy"] for r in rows if r["ok"] is not None}
            skipped = {r["strategy"] for r in rows if r["ok"] is None}
            assert ran and all(r["not_run"] for r in rows if r["ok"] is None)
            assert ran | skipped == _strategies("token" if case.startswith("token") else "sequence")
            assert all(sum(r["strategy"] == s for r in rows) == len(gpu_check.TENSORS) for s in ran)

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    tuning = json.loads((tmp_path / "tuning.json").read_text())  # auto's thresholds fitted to the bfloat16 cells
    assert tuning["commit"] == checks["commit"] and sum(len(c) for c in tuning["cells"].values()) > 0
    # timed on a CPU: not the CUDA tuning's numbers (it said measured: true and "copy them into the CUDA tuning")
    assert tuning["fields"]["measured"] is False and tuning["on_cuda"] is False
    assert "min_skipped_work" in (tmp_path / "table.md").read_text()
    assert "not for the CUDA tuning" in (tmp_path / "table.md").read_text()
    assert "copy them into" not in (tmp_path / "table.md").read_text()
    assert {"command", "commit", "device", "torch", "budget_s", "cells_total", "cells_done", "complete",
            "stopped", "cells", "records"} <= set(metrics)
    assert metrics["complete"] is True and metrics["stopped"] is None and metrics["cells_done"] == 8
    assert metrics["cells_failed"] == 0
    records = metrics["records"]
    assert {(r["granularity"], r["dtype"], r["pass"]) for r in records} == {
        (g, d, p) for g in ("sequence", "token") for d in ("bfloat16", "float32") for p in ("fwd", "fwd+bwd")}
    for cell in metrics["cells"]:
        mine = [r for r in records if (r["granularity"], r["s"], r["dtype"]) ==
                (cell["granularity"], cell["s"], cell["dtype"])]
        variants = {r["variant"] for r in mine}
        assert {"dense", "floor", "masked", "router", "gathered"} <= variants
        timed = {v[len("gathered["):-1] for v in variants if v.startswith("gathered[")}
        assert timed and timed | set(cell["rejected"]) == _strategies(cell["granularity"])
        assert not timed & set(cell["rejected"]) and all(cell["rejected"].values())
        assert (COMPILED in variants) != (COMPILED in cell["not_run"])  # timed, or why not
        assert cell["compile"] or "--compile" in cell["not_run"][COMPILED]
        assert cell["auto_strategy"] in timed
        profiled = cell["profile"]["calls"]  # dense and every gathered variant that ran, both passes
        assert set(profiled) == {f"{v} {p}" for v in variants if v == "dense" or v.startswith("gathered")
                                 for p in ("fwd", "fwd+bwd")}
        assert all(c["host_ms"] > 0 and c["device_ms"] is None for c in profiled.values())
        assert "aten::" in (tmp_path / cell["profile"]["file"]).read_text()
        tol = gpu_check.TOL[getattr(torch, cell["dtype"])]
        for r in mine:
            assert len(r["ms_reps"]) == 1 and r["ms"] > 0 and r["k"] == max(1, round(r["s"] * 8))
            assert r["paired_to_dense"] == 1.0 if r["variant"] == "dense" else r["paired_to_dense"] > 0
            if r["variant"].startswith("gathered"):  # the same plan through the masked executor
                assert r["rel_err_vs_masked"] <= tol, r
    text = (tmp_path / "table.md").read_text()
    assert "## Targets" in text and "not measured in this run" in text and metrics["commit"] in text
    assert sum(line.startswith("| B=2 T=16 D=64 H=8 |") for line in text.splitlines()) == 8 * 2  # cell x pass


@pytest.mark.slow
def test_the_budget_skips_what_does_not_fit_and_keeps_what_was_timed(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Cells 1 and 3 ask to compile but the budget has no room for a compiled cell: they run uncompiled, saying why.
    Cell 2 would not fit: it is not started, the run goes on to cell 3, exits 0, and the records name cell 2."""
    monkeypatch.setattr(gpu_check, "checks", lambda dev, quick, **_: [])  # checked by the test above
    three = cells(quick=True, compile_cells="targets")[:3]
    assert [c.compile for c in three] == [True, False, True]
    monkeypatch.setattr(gpu_check, "cells", lambda quick, compile_cells: three)

    def estimate(cell: Any, done: list, quick: bool) -> float:
        return 1e9 if cell.compile or cell.label == three[1].label else 0.0

    monkeypatch.setattr(gpu_check, "_estimate", estimate)
    assert condcomp_main([*QUICK, "--compile", "targets", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["cells_done"] == 2 and metrics["cells_total"] == 3 and metrics["complete"] is False
    assert "--budget-s 480" in metrics["stopped"] and metrics["not_started"] == [three[1].label]
    assert [c["cell"] for c in metrics["cells"]] == [three[0].label, three[2].label]
    assert all(c["not_run"][COMPILED].startswith("the budget") for c in metrics["cells"])
    assert {(r["granularity"], r["s"]) for r in metrics["records"]} == {
        (three[0].granularity, three[0].s), (three[2].granularity, three[2].s)}
    text = (tmp_path / "table.md").read_text()
    assert "stopped: --budget-s" in text and f"not started: {three[1].label}" in text

@pytest.mark.slow
def test_a_cell_that_raises_is_recorded_and_the_next_one_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "checks", lambda dev, quick, **_: [])  # checked by the test above
    two = cells(quick=True, compile_cells="off")[:2]
    monkeypatch.setattr(gpu_check, "cells", lambda quick, compile_cells: two)
    real = gpu_check.time_cell

    def time_cell(cell: Any, *args: Any, **kwargs: Any) -> Any:
        if cell == two[0]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(cell, *args, **kwargs)

    monkeypatch.setattr(gpu_check, "time_cell", time_cell)
    assert condcomp_main([*QUICK, "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["cells_done"] == 2 and metrics["cells_failed"] == 1 and metrics["complete"] is False
    assert "out of memory (simulated)" in metrics["cells"][0]["not_run"]["cell"]
    assert {r["s"] for r in metrics["records"]} == {two[1].s}


@pytest.mark.slow
def test_a_timed_strategy_with_a_wrong_answer_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timings compare every gathered variant with the masked executor on the same plan: a strategy whose output
    is off by half is named in the record and the run exits 1."""
    import condcomp.bench.gpu_cells as gpu_cells

    monkeypatch.setattr(gpu_check, "checks", lambda dev, quick, **_: [])  # checked by the test above
    one = cells(quick=True, compile_cells="off")[:1]
    monkeypatch.setattr(gpu_check, "cells", lambda quick, compile_cells: one)

    class HalfWrong(gpu_cells.GatheredExecutor):
        def __call__(self, *args: Any) -> torch.Tensor:
            y = super().__call__(*args)
            return y * 1.5 if self.strategy is not None else y

    monkeypatch.setattr(gpu_cells, "GatheredExecutor", HalfWrong)
    assert condcomp_main([*QUICK, "--out", str(tmp_path)]) == 1
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["wrong_answers"] and all("gathered[" in w for w in metrics["wrong_answers"])
    assert "## Wrong answers" in (tmp_path / "table.md").read_text()


@pytest.mark.slow
def test_a_compiled_path_failing_while_timed_leaves_the_cell_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled variant passes its first calls, then raises (as a CUDA-graph replay can): the cell is timed
    without it and says why."""
    import condcomp.bench.gpu_cells as gpu_cells

    def compiled(w: Any, x: torch.Tensor, plan: Any, backend: str) -> Any:
        calls = []

        def step() -> torch.Tensor:
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("replay failed (simulated)")
            return x * 1.0

        return step

    monkeypatch.setattr(gpu_cells, "_compiled", compiled)
    cell = cells(quick=True, compile_cells="targets")[0]
    records, summary = gpu_cells.time_cell(cell, torch.device("cpu"), 1, 0, "eager", torch.Generator().manual_seed(0))
    assert "replay failed (simulated)" in summary["not_run"][COMPILED]
    assert {r["variant"] for r in records} >= {"dense", "floor", "masked", "router", "gathered"}
    assert COMPILED not in {r["variant"] for r in records}


def test_a_check_that_raises_is_a_failed_record_and_the_timings_still_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A strategy raising in the checks (on a GPU: a kernel that fails to compile or launch) is one failed record
    naming the error; the other strategies are still checked, checks.json is rewritten after every case, the timed
    cells still run, and the run exits 1."""
    monkeypatch.setattr(gpu_check, "CASES", ("seq",))
    monkeypatch.setattr(gpu_check, "cells", lambda quick, compile_cells: [])

    class Broken(gpu_check.GatheredExecutor):
        def __call__(self, *args: Any) -> torch.Tensor:
            if self.strategy == "sequence.static":
                raise RuntimeError("triton compile failed (simulated)")
            return super().__call__(*args)

    monkeypatch.setattr(gpu_check, "GatheredExecutor", Broken)
    seen: list[int] = []
    real_write = gpu_check.write_checks

    def write_checks(out: Path, header: dict[str, Any], results: list[dict[str, Any]]) -> bool:
        seen.append(len(results))
        return real_write(out, header, results)

    monkeypatch.setattr(gpu_check, "write_checks", write_checks)
    assert condcomp_main([*QUICK, "--out", str(tmp_path)]) == 1
    checks = json.loads((tmp_path / "checks.json").read_text())
    assert checks["all_ok"] is False
    broken = [r for r in checks["checks"] if r["strategy"] == "sequence.static"]
    assert len(broken) == 2 and all(r["ok"] is False and "compile failed (simulated)" in r["error"] for r in broken)
    others = {r["strategy"] for r in checks["checks"] if r["ok"] is True}
    assert others and "sequence.static" not in others  # the other strategies still compared with the reference
    assert seen[:2] == sorted(seen[:2]) and 0 < seen[0] < seen[1] == seen[-1]  # per case (float32, bfloat16), then all
    assert json.loads((tmp_path / "metrics.json").read_text())["cells_total"] == 0  # the timing part ran


def test_a_profile_that_raises_keeps_the_cell_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler failing (CUPTI on a GPU) is recorded as the cell's profile error; the cell's timings were handed
    to ``on_timed`` before it ran (gpu-check writes them there) and are returned; the table names the error."""
    import condcomp.bench.gpu_cells as gpu_cells
    from condcomp.bench.gpu_report import table

    timed: list[int] = []

    def profile_variants(*args: Any, **kwargs: Any) -> Any:
        assert timed, "the records were not handed over before profiling"
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED (simulated)")

    monkeypatch.setattr(gpu_cells, "profile_variants", profile_variants)
    cell = cells(quick=True, compile_cells="off")[0]
    records, summary = gpu_cells.time_cell(cell, torch.device("cpu"), 1, 0, None, torch.Generator().manual_seed(0),
                                           tmp_path / "profiles", on_timed=lambda r, s: timed.append(len(r)))
    assert timed == [len(records)] and {"dense", "floor", "masked", "gathered"} <= {r["variant"] for r in records}
    assert "CUPTI_ERROR_NOT_INITIALIZED (simulated)" in summary["profile"]["error"]
    meta = {"command": "c", "commit": "x", "device": "cpu", "torch": torch.__version__, "started_utc": "-",
            "cells_total": 1, "cells_done": 1, "cells_failed": 0, "complete": True, "stopped": None, "not_started": [],
            "wrong_answers": [], "elapsed_s": 1.0, "budget_s": 10.0}
    text = table(meta, records, [summary])
    assert "| profile | RuntimeError: CUPTI_ERROR_NOT_INITIALIZED (simulated) |" in text


def test_a_process_killed_while_profiling_leaves_the_cell_written(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu-check writes a cell's records before profiling it: a profiler that takes the process down (simulated by
    an exception no handler catches) leaves metrics.json with that cell timed."""
    import condcomp.bench.gpu_cells as gpu_cells

    class Killed(BaseException):
        pass

    def profile_variants(*args: Any, **kwargs: Any) -> Any:
        raise Killed

    monkeypatch.setattr(gpu_check, "CASES", ("seq",))
    one = cells(quick=True, compile_cells="off")[:1]
    monkeypatch.setattr(gpu_check, "cells", lambda quick, compile_cells: one)
    monkeypatch.setattr(gpu_cells, "profile_variants", profile_variants)
    with pytest.raises(Killed):
        condcomp_main([*QUICK, "--profile", "all", "--out", str(tmp_path)])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["cells_done"] == 1 and [c["cell"] for c in metrics["cells"]] == [one[0].label]
    assert {"dense", "floor", "masked", "gathered"} <= {r["variant"] for r in metrics["records"]}


def test_a_compiled_variant_run_without_cuda_graphs_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``graph_skips``: the graphs inductor compiled without the CUDA graphs ``reduce-overhead`` asked for (its
    counter, bumped here once by a stand-in for the compiled path's first call)."""
    from torch._dynamo.utils import counters

    import condcomp.bench.gpu_cells as gpu_cells

    def compiled(w: Any, x: torch.Tensor, plan: Any, backend: str) -> Any:
        calls = []

        def step() -> torch.Tensor:
            if not calls:
                counters["inductor"]["cudagraph_skips"] += 1  # what inductor does when it cannot graph a call
            calls.append(1)
            return x * 1.0

        return step

    monkeypatch.setattr(gpu_cells, "_compiled", compiled)
    cell = cells(quick=True, compile_cells="targets")[0]
    records, summary = gpu_cells.time_cell(cell, torch.device("cpu"), 1, 0, "eager", torch.Generator().manual_seed(0))
    assert summary["graph_skips"] == 1 and COMPILED in {r["variant"] for r in records}
    _, uncompiled = gpu_cells.time_cell(cell, torch.device("cpu"), 1, 0, None, torch.Generator().manual_seed(0))
    assert "graph_skips" not in uncompiled
