"""``condcomp bench gpu-check``: one prepared GPU run in one process: every strategy of the gathered executor checked
against the reference executor, then dense / the k-head floor / masked / gathered timed side by side.

    condcomp bench gpu-check --out results/bench/gpu_check/h100                 # on a CUDA GPU, within 480 s
    condcomp bench gpu-check --device cpu --quick --out /tmp/gpu_check         # end to end on CPU, tiny shapes
    TRITON_INTERPRET=1 condcomp bench gpu-check --device cpu --quick --out /tmp/gpu_check  # + the Triton strategies

1. Checks: each strategy of the gathered dispatch table that can run a case (``GatheredExecutor(strategy=NAME)``
   under ``every_strategy_tuning``: the opt-in Triton kernels included; the others with their reasons) against the
   per-head ``reference`` executor, the output and every gradient, float32 and bfloat16, 8 cases (sequence and
   token plans, causal, GQA, a shared head set, padding).
2. Timings (``condcomp.bench.gpu_cells``): forward and forward+backward, bfloat16 and float32, at B=8 T=2048 D=2048
   H=32 and B=64 T=512 D=768 H=12, s in {0.125, 0.25, 0.5, 1.0}, sequence plans (fixed top-k) and token plans (MoH),
   cells in priority order (the GPU target rows first), the router timed apart.

``--budget-s`` bounds the whole run: a cell that would not finish in the time left is not started (a later, smaller
one may be), and the records (rewritten after every cell) name the cells not started. Writes ``checks.json``,
``metrics.json``, ``tuning.json`` (``auto``'s CUDA thresholds fitted to the bfloat16 cells:
``condcomp.bench.gpu_tuning``) and ``table.md`` into ``--out``, each with the command, commit and device (strict
JSON: a non-finite number, such as a fitted "never" threshold, is the string ``"inf"``). Exits 1 if
a check fails or a timed gathered variant's output differs from the masked executor's on the same plan by more than
the checks' tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from condcomp.bench.gpu_cells import COMPILED, Cell, cells, every_strategy_tuning, time_cell
from condcomp.bench.gpu_report import table
from condcomp.bench.gpu_tuning import tuning_lines, tuning_record
from condcomp.cli_args import compile_backend, finite_float, integer, output_folder
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import GatheredExecutor
from condcomp.executors.gathered.pairs import tf32_matmul
from condcomp.plans import plan_from_active, top_k_mask
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout, HeadPlan

TOL = {torch.float32: 2e-3, torch.bfloat16: 5e-2}  # max abs error relative to the output's max abs value
GRAD_TOL = 4  # gradients: this many times the output's tolerance
CASES = ("seq", "seq_causal", "seq_gqa", "seq_same", "token", "token_per_head", "token_causal", "token_gqa")
TENSORS = ("y", "x", "q_weight", "k_weight", "o_weight", "o_bias", "gates")
# (B, T, D, H, Dh); the GPU run's sizes leave partial tiles: T = 80 is not a multiple of the kernels' 64-row tiles
# and Dh = 40 not a power of two (partial output and reduction tiles), where a masked load or store would go wrong
CHECK_SIZES = {False: (6, 80, 320, 8, 40), True: (6, 16, 64, 8, 8)}  # True: --quick
DEFAULT_BUDGET_S = 480.0  # one device command runs at most 10 minutes: the rest is start-up and margin
MARGIN_S = 10.0  # kept for writing the records after the last cell


def case(name: str, dtype: torch.dtype, dev: torch.device, quick: bool = False) -> tuple[
        AttentionWeights, AttentionInputs, HeadPlan, list[torch.Tensor]]:
    B, T, D, H, Dh = CHECK_SIZES[quick]
    Hkv = 2 if "gqa" in name else H
    layout = HeadLayout(D, H, Hkv, Dh, Dh**-0.5, causal="causal" in name)

    def p(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dtype).requires_grad_()

    w = AttentionWeights(layout, p(H * Dh, D), p(Hkv * Dh, D), p(Hkv * Dh, D), p(D, H * Dh), p(H * Dh),
                         p(Hkv * Dh), p(Hkv * Dh), p(D))
    x = torch.randn(B, T, D, device=dev).to(dtype).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    mask[1, T * 5 // 8:] = False
    mask[4] = False  # an all-padding example
    if "token" in name:
        active = top_k_mask(torch.rand(B, T, H, device=dev), 2) & mask.unsqueeze(-1)
        active[..., :2] = mask.unsqueeze(-1)  # two shared heads
    elif "same" in name:
        active = torch.zeros(B, H, dtype=torch.bool, device=dev)
        active[:, [1, 2, 6]] = True
    else:
        active = top_k_mask(torch.rand(B, H, device=dev), torch.tensor([0, 1, H, 3, 2, 3], device=dev))
    gates = (torch.rand(active.shape, device=dev) + 0.5).requires_grad_()
    # token plans declare their shape (two shared heads, at most two routed): token.static / token.triton use it
    token = "token" in name
    plan = plan_from_active(active, gates, k_cap=4 if token else None, shared_heads=2 if token else 0)
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask)
    return w, inputs, plan, [x, w.q_weight, w.k_weight, w.o_weight, w.o_bias, gates]  # type: ignore[list-item]


def _outputs(ex: Any, w: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
             leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    y = ex(w, inputs, plan)
    # the plan's gates are one graph shared by every executor: keep it for the next backward
    return [y, *torch.autograd.grad(y.float().square().sum(), leaves, retain_graph=True)]


def checks(dev: torch.device, quick: bool = False,
           progress: Callable[[list[dict[str, Any]]], object] | None = None) -> list[dict[str, Any]]:
    """Every strategy of the gathered dispatch table that can run each case against the reference executor: one
    record per (case, dtype, strategy, tensor) with its error and tolerance, and one per strategy that cannot run a
    case with its reasons (``ok`` None). The per-set token strategy's size rule is lifted so it runs at these sizes.
    A strategy (or the reference) that raises is one failed record (``ok`` False, ``tensor`` None, ``error``: the
    exception), and the checks go on: the timings after them still run. ``progress``: called with the records so far
    after every case (gpu-check rewrites ``checks.json`` with it, so a run cut short keeps the checks it made)."""
    results: list[dict[str, Any]] = []
    ref = get_executor("reference")
    tuning = every_strategy_tuning(dev)
    for dtype in (torch.float32, torch.bfloat16):
        for name in CASES:
            torch.manual_seed(0)
            w, inputs, plan, leaves = case(name, dtype, dev, quick)
            try:
                expected = _outputs(ref, w, inputs, plan, leaves)
                found = GatheredExecutor(tuning=tuning).explain(w, inputs, plan)
            except Exception as e:  # on the device only, e.g. a CUDA error: recorded, the next case runs
                results.append(_raised({"case": name, "dtype": str(dtype), "strategy": "reference"}, e))
                found = []
            for strategy, reasons in found:
                row = {"case": name, "dtype": str(dtype), "strategy": strategy}
                if reasons:
                    results.append({**row, "tensor": None, "ok": None, "not_run": reasons})
                    continue
                try:
                    got = _outputs(GatheredExecutor(tuning=tuning, strategy=strategy), w, inputs, plan, leaves)
                except Exception as e:  # a kernel that fails to compile or launch here: a failed check, not a crash
                    results.append(_raised(row, e))
                    continue
                worst = 0.0
                for label, a, b in zip(TENSORS, expected, got):
                    a, b = a.detach().float(), b.detach().float()
                    err = float((a - b).abs().max() / a.abs().max().clamp_min(1e-6))
                    tol = TOL[dtype] * (1 if label == "y" else GRAD_TOL)
                    results.append({**row, "tensor": label, "rel_err": err, "tol": tol, "ok": err <= tol})
                    worst = max(worst, err / tol)
                print(f"{'ok ' if worst <= 1 else 'FAIL'} {name:14s} {str(dtype):15s} {strategy:24s} "
                      f"worst error / tolerance = {worst:.2e}", flush=True)
            if progress is not None:
                progress(results)
    return results


def _raised(row: dict[str, Any], error: Exception) -> dict[str, Any]:
    """The record of a check whose executor raised (printed as it happens)."""
    text = f"{type(error).__name__}: {str(error).strip()[:500]}"
    print(f"FAIL {row['case']:14s} {row['dtype']:15s} {row['strategy']:24s} raised {text.splitlines()[0]}",
          flush=True)
    return {**row, "tensor": None, "ok": False, "error": text}


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float as the string ``"inf"``, ``"-inf"`` or ``"nan"``: json.dumps writes
    ``Infinity``/``NaN``, which strict JSON readers (jq, JavaScript, most other languages) refuse, and a fit whose
    path is "never gathered" holds ``inf`` (``tuning.json``). Python reads the strings back with ``float()``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def write_json(path: Path, value: Any) -> None:
    """Write one of the run's records as strict JSON (:func:`_strict`)."""
    path.write_text(json.dumps(_strict(value), indent=1, allow_nan=False))


def write_checks(out: Path, header: dict[str, Any], results: list[dict[str, Any]]) -> bool:
    """Rewrite ``checks.json`` with the checks so far; returns whether none failed."""
    all_ok = all(r["ok"] is not False for r in results)
    write_json(out / "checks.json", {**header, "all_ok": all_ok, "checks": results})
    return all_ok


def _commit() -> str:
    """This checkout's commit (``+dirty`` with uncommitted changes to tracked files), else ``$CONDCOMP_COMMIT``."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("CONDCOMP_COMMIT", "unknown (no git checkout; set CONDCOMP_COMMIT)")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run."""
    return (f"condcomp bench gpu-check --device {args.device} --out {args.out} --budget-s {args.budget_s:g} "
            f"--compile {args.compile} --compile-backend {args.compile_backend} --profile {args.profile}"
            + (f" --reps {args.reps}" if args.reps else "") + (" --quick" if args.quick else ""))


def run_header(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    return {"command": command_line(args), "commit": _commit(),
            "device": torch.cuda.get_device_name(dev) if cuda else f"CPU ({os.cpu_count()} cores)",
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "triton": _version("triton"),
            "tf32_matmul": tf32_matmul() if cuda else None,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "budget_s": args.budget_s, "threads": torch.get_num_threads()}


def _estimate(cell: Cell, done: list[tuple[Cell, float, float]], quick: bool) -> float:
    """Seconds a cell is expected to take, from the finished cells (``done``: cell, seconds, of which compiling):
    the longest timing of its shape and dtype (else twice that of its shape, else a first guess), plus, for a
    compiled cell, the longest compile of its shape (else of any shape, else a first guess)."""
    timing = [t - c for d, t, c in done if (d.shape, d.dtype) == (cell.shape, cell.dtype)]
    timing = timing or [2 * (t - c) for d, t, c in done if d.shape == cell.shape]
    guess = max(timing) if timing else (5.0 if quick else 30.0)
    if cell.compile:
        compiles = [c for d, _, c in done if d.compile and d.shape == cell.shape]
        compiles = compiles or [c for d, _, c in done if d.compile]
        guess += max(compiles) if compiles else (0.0 if quick else 90.0)
    return guess


def run(args: argparse.Namespace, dev: torch.device, start: float, header: dict[str, Any],
        out: Path) -> dict[str, Any]:
    """Time the cells in priority order until they are done or the budget is near, rewriting the records after
    every cell; returns the run's summary fields (``write``)."""
    compile_cells = args.compile
    compile_note = ""
    if compile_cells == "auto":
        compile_cells = "targets" if dev.type == "cuda" else "off"
        compile_note = "" if dev.type == "cuda" else "CPU: pass --compile targets or all to compile on CPU"
    todo = cells(args.quick, compile_cells)
    header["cells_total"], header["stopped"], header["not_started"] = len(todo), None, []
    reps, warmup = args.reps or (2 if args.quick else 11), 1 if args.quick else 3
    records: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    done: list[tuple[Cell, float, float]] = []
    gen = torch.Generator().manual_seed(0)

    def timed(cell_records: list[dict[str, Any]], summary: dict[str, Any]) -> None:
        """A cell's records, written once timed, before the profiler runs: a crash while profiling keeps them."""
        write(out, header, records + cell_records, [*summaries, summary], time.monotonic() - start)

    for i, cell in enumerate(todo):
        left = args.budget_s - MARGIN_S - (time.monotonic() - start)
        if cell.compile and (needed := _estimate(cell, done, args.quick)) > left:
            cell = replace(cell, compile=False)
            why = f"the budget: {left:.0f} s left, a compiled cell needs about {needed:.0f}"
        else:
            why = compile_note or "not a compiled cell (--compile)"
        needed = _estimate(cell, done, args.quick)
        if needed > left:  # not started; a later, smaller cell may still fit
            header["not_started"].append(cell.label)
            header["stopped"] = header["stopped"] or (f"--budget-s {args.budget_s:g}: {left:.0f} s left before cell "
                                                      f"{i + 1} ({cell.label}), which needs about {needed:.0f} s")
            print(f"not started: {cell.label} (about {needed:.0f} s needed, {left:.0f} s left)", flush=True)
            continue
        t0 = time.monotonic()
        try:
            profile = args.profile == "all" or (args.profile == "targets" and cell.target)
            cell_records, summary = time_cell(
                cell, dev, reps, warmup, args.compile_backend if cell.compile else None, gen,
                out / "profiles" if profile else None, on_timed=timed)
        except Exception as e:  # out of memory, a variant failing mid-timing: recorded, and the next cell runs
            cell_records, summary = [], failed_cell(cell, e, time.monotonic() - t0)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if not cell.compile:
            summary["not_run"][COMPILED] = why
        profiled = summary.get("profile", {}).get("seconds", 0.0)  # a cost of this cell, not of its shape
        done.append((cell, summary["seconds"] - profiled, summary.get("compile_s", 0.0)))
        records += cell_records
        summaries.append(summary)
        print(progress(i, len(todo), time.monotonic() - start, cell, cell_records, summary), flush=True)
        write(out, header, records, summaries, time.monotonic() - start)
    return write(out, header, records, summaries, time.monotonic() - start)


def failed_cell(cell: Cell, error: Exception, seconds: float) -> dict[str, Any]:
    """The summary of a cell that raised: nothing of it was timed; ``not_run["cell"]`` holds the error."""
    B, T, D, H = cell.shape
    return {"cell": cell.label, "shape": {"B": B, "T": T, "D": D, "H": H}, "granularity": cell.granularity,
            "s": cell.s, "dtype": cell.dtype, "target_cell": cell.target, "compile": cell.compile,
            "auto_strategy": None, "rejected": {}, "seconds": round(seconds, 2),
            "not_run": {"cell": f"{type(error).__name__}: {str(error).strip()[:300]}"}}


def progress(i: int, total: int, elapsed: float, cell: Cell, records: list[dict[str, Any]],
             summary: dict[str, Any]) -> str:
    if not records:
        return f"[{i + 1}/{total} {elapsed:.0f}s] {cell.label}: FAILED {summary['not_run']['cell']}"
    fwd = {r["variant"]: r for r in records if r["pass"] == "fwd"}
    parts = [f"dense {fwd['dense']['ms']:.3f} ms"] if "dense" in fwd else []
    parts += [f"{v} {r['paired_to_floor']:.2f}xf" for v, r in fwd.items() if v.startswith("gathered")]
    return (f"[{i + 1}/{total} {elapsed:.0f}s] {cell.label}: fwd {', '.join(parts)} "
            f"(auto: {summary['auto_strategy']}; {summary['seconds']:.1f} s)")


def wrong_answers(records: list[dict[str, Any]]) -> list[str]:
    """Timed gathered variants whose output differed from ``masked``'s on the same plan by more than the checks'
    output tolerance (a wrong answer at a timed shape the checks do not cover)."""
    return [f"{r['shape']} {r['granularity']} s={r['s']} {r['dtype']} {r['variant']}: {r['rel_err_vs_masked']:.2e}"
            for r in records if r["pass"] == "fwd" and r.get("rel_err_vs_masked") is not None
            and r["rel_err_vs_masked"] > TOL[getattr(torch, r["dtype"])]]


def write(out: Path, header: dict[str, Any], records: list[dict[str, Any]], summaries: list[dict[str, Any]],
          elapsed: float) -> dict[str, Any]:
    """Rewrite ``metrics.json`` and ``table.md`` with everything timed so far; returns the run's summary fields."""
    meta = {**header, "elapsed_s": round(elapsed, 1), "cells_done": len(summaries),
            "cells_failed": sum("cell" in c["not_run"] for c in summaries), "wrong_answers": wrong_answers(records)}
    meta["complete"] = meta["cells_done"] == header["cells_total"] and not meta["cells_failed"]
    write_json(out / "metrics.json", {**meta, "cells": summaries, "records": records})
    tuning = tuning_record(records, on_cuda=header.get("cuda") is not None)
    write_json(out / "tuning.json", {**header, **tuning})
    (out / "table.md").write_text(table(meta, records, summaries) + "\n\n" + "\n".join(tuning_lines(tuning)) + "\n")
    return meta


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=output_folder, required=True,
                        help="folder for checks.json, metrics.json and table.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu runs the same code, for a dry run (needs --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes (checks and timings), s in {0.25, 1.0}, 2 repetitions: a smoke test")
    parser.add_argument("--budget-s", type=finite_float(above=0), default=DEFAULT_BUDGET_S,
                        help=f"wall-clock seconds for the whole run (default {DEFAULT_BUDGET_S:g}): the checks always "
                        "run first (they count against it), then no cell is started that would not finish in time; "
                        "what was timed is written")
    parser.add_argument("--reps", type=integer(at_least=1), default=None,
                        help="timed repetitions per variant and pass (default 11; 2 with --quick)")
    parser.add_argument("--compile", choices=("auto", "targets", "all", "off"), default="auto",
                        help="cells that also time the gathered executor under torch.compile(mode='reduce-overhead', "
                        "fullgraph=True): auto (the target cells on CUDA, none on CPU), targets, all or off")
    parser.add_argument("--profile", choices=("targets", "all", "off"), default="targets",
                        help="cells whose dense and gathered calls are also run under torch.profiler (host vs device "
                        "time, the top operators, in profiles/): the target cells (default), all or none")
    parser.add_argument("--compile-backend", default="inductor", type=compile_backend,
                        help="torch.compile backend for those cells (default inductor; eager: a quick capture check)")


def main(args: argparse.Namespace | None = None) -> int:
    """Entry point of ``condcomp bench gpu-check`` and ``python -m condcomp.bench.gpu_check``."""
    start = time.monotonic()
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args()
    if args.device == "cpu" and not args.quick:  # the GPU grid on a CPU takes hours and measures nothing useful
        print("gpu_check: --device cpu without --quick would run the full GPU grid on a CPU (hours); add --quick "
              "for the dry run on tiny shapes, or run it on a CUDA GPU (--device cuda)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch.cuda.is_available() is False; run it on a machine with a CUDA GPU, or pass "
              "--device cpu (with --quick) for a dry run", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    header = run_header(args, dev)
    print(f"{header['device']}, torch {header['torch']}, commit {header['commit']}", flush=True)
    results = checks(dev, args.quick, progress=lambda so_far: write_checks(out, header, so_far))
    all_ok = write_checks(out, header, results)
    header["checks"] = (f"{sum(r['ok'] is True for r in results)} passed, {sum(r['ok'] is False for r in results)} "
                        f"failed, {sum(r['ok'] is None for r in results)} not run (a strategy that cannot run a case; "
                        "checks.json says why)")
    header["quick"] = bool(args.quick)
    meta = run(args, dev, start, header, out)
    print((out / "table.md").read_text())
    return 0 if all_ok and not meta["wrong_answers"] else 1


def add_bench_commands(bench_subparsers: Any) -> None:
    """Register ``condcomp bench gpu-check``."""
    p = bench_subparsers.add_parser("gpu-check", help="on a CUDA GPU: every gathered strategy checked against the "
                                    "reference, then dense / floor / masked / gathered timed within a time budget "
                                    "(checks.json, metrics.json, table.md)")
    add_arguments(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(main())
