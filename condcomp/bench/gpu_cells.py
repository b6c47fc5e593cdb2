"""The timed part of ``condcomp bench gpu-check``: its cells (shape x plan granularity x budget x dtype), in priority
order, and what one cell times.

A cell times, forward and forward+backward, with the variants interleaved repetition by repetition
(``condcomp.bench.attention.time_group``) and every ratio paired to dense within its repetition:

- ``dense``: the unwrapped block, all H heads; ``floor``: a dense block built with only k = round(s * H) heads;
- ``masked``: the masked executor on the cell's plan (all heads, then gates);
- ``gathered``: ``GatheredExecutor()``, as ``executor="gathered"`` runs it (its dispatch table chooses the strategy,
  recorded);
- ``gathered[NAME]``: each strategy of the dispatch table that can run the call (``GatheredExecutor(strategy=NAME)``;
  the others are recorded with their reasons);
- ``gathered+compile``: the gathered executor under ``torch.compile(mode="reduce-overhead", fullgraph=True)``
  (CUDA graphs on CUDA); a failure to compile is recorded as the reason it did not run, and the cell's
  ``graph_skips`` counts its graphs inductor compiled without CUDA graphs (0 on CUDA: every call replays one);
- ``router``: the router and budget policy alone (scores, top-k, the plan), timed apart: the executors run on the
  plan it made once, with its gates as a leaf so that their gradient is still computed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from condcomp.bench.attention import Block, draw_ks, make_router, paired_ratio, time_group
from condcomp.bench.decode_compiled import cudagraph_skips
from condcomp.bench.gpu_profile import profile_variants
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import GatheredExecutor, GatheredTuning, pairs, tuning_for
from condcomp.types import AttentionInputs, HeadPlan

SHAPES = ((8, 2048, 2048, 32), (64, 512, 768, 12))  # (B, T, D, H)
QUICK_SHAPES = ((2, 16, 64, 8),)
BUDGETS = (0.125, 0.25, 0.5, 1.0)
QUICK_BUDGETS = (0.25, 1.0)
GRANULARITIES = ("sequence", "token")
DTYPES = ("bfloat16", "float32")
PASSES = ("fwd", "fwd+bwd")
COMPILED = "gathered+compile"


@dataclass(frozen=True)
class Target:
    """One row of the GPU targets: ``variant``'s paired ratio ``versus`` dense or floor, at most ``bound``."""

    shape: tuple[int, int, int, int]
    granularity: str
    s: float
    passes: str
    versus: str
    bound: float


TARGETS = (  # bfloat16, one H100 or H200, router excluded
    Target((8, 2048, 2048, 32), "sequence", 0.25, "fwd", "floor", 1.25),
    Target((8, 2048, 2048, 32), "sequence", 0.25, "fwd+bwd", "floor", 1.35),
    Target((8, 2048, 2048, 32), "sequence", 1.0, "fwd", "dense", 1.05),
    Target((64, 512, 768, 12), "sequence", 0.25, "fwd", "floor", 1.3),
    Target((8, 2048, 2048, 32), "token", 0.5, "fwd", "dense", 1.0),
)


@dataclass(frozen=True)
class Cell:
    """One timed situation. ``target``: a target row's cell (timed first); ``compile``: time ``gathered+compile``."""

    B: int
    T: int
    D: int
    H: int
    granularity: str
    s: float
    dtype: str
    target: bool = False
    compile: bool = False

    @property
    def label(self) -> str:
        return f"B={self.B} T={self.T} D={self.D} H={self.H} {self.granularity} s={self.s} {self.dtype}"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.T, self.D, self.H)


def is_target(shape: tuple[int, int, int, int], granularity: str, s: float, dtype: str) -> bool:
    return dtype == "bfloat16" and any((t.shape, t.granularity, t.s) == (shape, granularity, s) for t in TARGETS)


def cells(quick: bool = False, compile_cells: str = "targets") -> list[Cell]:
    """Every cell, the targets' first (in the order of :data:`TARGETS`), then bfloat16, then float32, larger
    shapes and lower budgets first. ``compile_cells``: ``targets`` (compile the target cells; in a quick run the
    first cell of each granularity), ``all`` or ``off``."""
    shapes, budgets = (QUICK_SHAPES, QUICK_BUDGETS) if quick else (SHAPES, BUDGETS)
    every = [Cell(*shape, g, s, dtype, target=is_target(shape, g, s, dtype))
             for dtype in DTYPES for shape in shapes for g in GRANULARITIES for s in budgets]
    first = []
    for t in TARGETS:
        for c in every:
            if c.target and (c.shape, c.granularity, c.s) == (t.shape, t.granularity, t.s) and c not in first:
                first.append(c)
    ordered = first + [c for c in every if c not in first]
    if compile_cells == "all":
        return [replace(c, compile=True) for c in ordered]
    if compile_cells == "off":
        return ordered
    compiled = [c for c in ordered if c.target] if not quick else \
        [next(c for c in ordered if c.granularity == g) for g in GRANULARITIES]
    return [replace(c, compile=c in compiled) for c in ordered]


def _leaf_gates(plan: HeadPlan) -> HeadPlan:
    """The plan with its gates cut from the router's graph and made a leaf: the executors' backward still computes
    the gates' gradient, and the router's own time stays in its own row."""
    return replace(plan, gates=plan.gates.detach().requires_grad_())


def every_strategy_tuning(device: torch.device) -> GatheredTuning:
    """The device's tuning with every strategy allowed: calls sized (so the sized strategies are listed too) and the
    opt-in Triton pair kernels on; each strategy is then forced by name (an unsized one runs unsized). On CPU under
    Triton's interpreter (``TRITON_INTERPRET=1``) the kernels run there too (float32; bfloat16 through the ops' torch
    fallback), so that a CPU dry run checks the Triton strategies the GPU run will."""
    on_cpu = device.type == "cpu" and pairs.interpreting() and pairs.triton_available()
    return replace(tuning_for(device), static_sequence=False, static_token=False, pair_kernels=True, min_set_work=0,
                   pair_kernels_on_cpu=on_cpu)


def _compiled(w: Any, x: Tensor, plan: HeadPlan, backend: str) -> Callable[[], Tensor]:
    """``gathered`` under ``torch.compile(fullgraph=True)``; mode ``reduce-overhead`` (CUDA graphs) with inductor."""
    gathered = GatheredExecutor()

    def block(x: Tensor, gates: Tensor, active: Tensor, counts: Tensor, order: Tensor) -> Tensor:
        return gathered(w, AttentionInputs(x=x), HeadPlan(plan.granularity, gates, active, counts, order,
                                                          k_cap=plan.k_cap, shared_heads=plan.shared_heads))

    torch._dynamo.reset()  # a fresh cache per cell: no recompile limit reached across cells
    kwargs: dict[str, Any] = {"mode": "reduce-overhead"} if backend == "inductor" else {}
    fn = torch.compile(block, fullgraph=True, backend=backend, **kwargs)

    def step() -> Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are no longer used
        return fn(x, plan.gates, plan.active, plan.counts, plan.order)

    return step


def variants(dense: Block, floor: Block, x: Tensor, router: Callable[[Tensor], HeadPlan],
             compile_backend: str | None) -> tuple[dict[str, Callable[[], Tensor]], HeadPlan, dict[str, Any]]:
    """The cell's timed callables, the plan they run on, and facts about them: the strategy ``gathered`` chose and
    why each strategy of the dispatch table that cannot run the call does not (``rejected``)."""
    w = dense.weights()
    with torch.no_grad():
        plan = _leaf_gates(router(x))
    inputs = AttentionInputs(x=x)
    masked, gathered = get_executor("masked"), GatheredExecutor()
    fns: dict[str, Callable[[], Tensor]] = {
        "dense": lambda: dense.forward(x),
        "floor": lambda: floor.forward(x),
        "router": lambda: router(x).gates,
        "masked": lambda: masked(w, AttentionInputs(x=x), plan),
        "gathered": lambda: gathered(w, AttentionInputs(x=x), plan),
    }
    facts: dict[str, Any] = {"auto_strategy": gathered.prepare(w, inputs, plan).strategy, "rejected": {}}
    every = every_strategy_tuning(x.device)
    for name, reasons in GatheredExecutor(tuning=every).explain(w, inputs, plan):
        if reasons:
            facts["rejected"][name] = reasons
        else:
            fns[f"gathered[{name}]"] = (lambda ex: lambda: ex(w, AttentionInputs(x=x), plan))(
                GatheredExecutor(tuning=every, strategy=name))
    if compile_backend is not None:
        fns[COMPILED] = _compiled(w, x, plan, compile_backend)
    return fns, plan, facts


def _rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-6))


def probe(fns: dict[str, Callable[[], Tensor]], leaves: list[Tensor]) -> tuple[dict[str, str], dict[str, float],
                                                                              dict[str, float]]:
    """Run every variant once per pass (compiling what compiles) before timing. Returns the variants that failed
    with the error (they are dropped from ``fns``), each executor's largest error relative to ``masked`` on the
    same plan (a wrong answer at the timed shape shows here) and the seconds each variant's first calls took."""
    failed: dict[str, str] = {}
    errors: dict[str, float] = {}
    seconds: dict[str, float] = {}
    with torch.no_grad():
        ref = fns["masked"]().clone()
    for name in list(fns):
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                y = fns[name]()
                if name.startswith("gathered"):
                    errors[name] = round(_rel_err(ref, y), 6)
            y = fns[name]()
            y.backward(torch.ones_like(y))
        except Exception as e:  # compile failures, a strategy's own error: recorded, never hidden
            failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            del fns[name]
        for t in leaves:
            t.grad = None
        seconds[name] = time.monotonic() - t0
    return failed, errors, seconds


def time_cell(cell: Cell, device: torch.device, reps: int, warmup: int, compile_backend: str | None,
              gen: torch.Generator, profile_dir: Path | None = None,
              on_timed: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time one cell; returns its ``metrics.json`` records (one per variant and pass) and the cell's summary
    (``not_run``: each variant that did not run, with why). ``compile_backend``: None, or the ``torch.compile``
    backend of ``gathered+compile`` in this cell (``inductor``: with ``mode="reduce-overhead"``); ``profile_dir``:
    profile the cell after timing it (``condcomp.bench.gpu_profile``) and write the operator tables there; a profile
    that raises is recorded (``summary["profile"]["error"]``), never losing the timings. ``on_timed``: called with
    the records and summary once timed, before profiling (gpu-check writes them: a profiler that crashes the
    process, as CUPTI can with CUDA graphs, leaves them written)."""
    t0 = time.monotonic()
    B, T, D, H = cell.shape
    Dh, dtype = D // H, getattr(torch, cell.dtype)
    n = max(1, round(cell.s * H))
    torch.manual_seed(0)
    dense = Block.random(D, H, Dh, device, dtype)
    floor = Block.random(D, n, Dh, device, dtype)
    x = torch.randn(B, T, D, device=device, dtype=dtype).requires_grad_()
    router = make_router(cell.granularity, D, H, n, draw_ks(B, n, H, gen).to(device), device)
    fns, plan, facts = variants(dense, floor, x, router, compile_backend)
    leaves = [x, plan.gates, *dense.parameters(), *floor.parameters()]
    skips = cudagraph_skips()  # only the compiled variant compiles: its graphs inductor ran without CUDA graphs
    failed, errors, first_calls = probe(fns, leaves)
    try:
        timed = time_group(fns, PASSES, reps, warmup, device, leaves)
    except Exception as e:  # the compiled path (CUDA graphs) failing after its first calls: time the rest without it
        if COMPILED not in fns:
            raise
        failed[COMPILED] = f"failed while timed: {type(e).__name__}: {str(e).strip()[:300]}"
        del fns[COMPILED]
        for t in leaves:
            t.grad = None
        timed = time_group(fns, PASSES, reps, warmup, device, leaves)
    skips = cudagraph_skips() - skips
    records = []
    for (variant, pas), (reps_ms, _) in timed.items():
        records.append({
            "shape": {"B": B, "T": T, "D": D, "H": H}, "granularity": cell.granularity, "s": cell.s, "k": n,
            "dtype": cell.dtype, "variant": variant, "pass": pas, "target_cell": cell.target,
            # the compiled path's strategy is the executor's choice under torch.compile: not read here
            "strategy": (facts["auto_strategy"] if variant == "gathered" else
                         variant[len("gathered["):-1] if variant.startswith("gathered[") else None),
            "ms": round(statistics.median(reps_ms), 4), "ms_reps": [round(t, 4) for t in reps_ms],
            "paired_to_dense": round(paired_ratio(reps_ms, timed[("dense", pas)][0]), 4),
            "paired_to_floor": round(paired_ratio(reps_ms, timed[("floor", pas)][0]), 4),
            "rel_err_vs_masked": errors.get(variant)})
    if device.type == "cuda":
        torch.cuda.empty_cache()
    summary = {"cell": cell.label, "shape": {"B": B, "T": T, "D": D, "H": H}, "granularity": cell.granularity,
               "s": cell.s, "k": n, "dtype": cell.dtype, "target_cell": cell.target, "compile": cell.compile,
               "auto_strategy": facts["auto_strategy"], "rejected": facts["rejected"], "not_run": failed,
               "seconds": round(time.monotonic() - t0, 2), "compile_s": round(first_calls.get(COMPILED, 0.0), 2)}
    if compile_backend is not None:
        summary["graph_skips"] = skips
    if on_timed is not None:
        on_timed(records, summary)
    if profile_dir is not None:
        t1 = time.monotonic()
        try:
            calls, text = profile_variants(fns, PASSES, device, leaves)
            profile_dir.mkdir(parents=True, exist_ok=True)
            path = profile_dir / (cell.label.replace(" ", "_").replace("=", "") + ".txt")
            path.write_text(f"# {cell.label}\n\n{text}")
            summary["profile"] = {"file": f"{profile_dir.name}/{path.name}", "calls": calls,
                                  "seconds": round(time.monotonic() - t1, 2)}
        except Exception as e:  # the profiler failing (CUPTI on a device): the cell stays timed, the error recorded
            summary["profile"] = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}",
                                  "seconds": round(time.monotonic() - t1, 2)}
            for t in leaves:
                t.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        summary["seconds"] = round(time.monotonic() - t0, 2)
    return records, summary
