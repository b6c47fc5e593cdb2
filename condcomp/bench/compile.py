"""``condcomp bench compile``: eager vs ``torch.compile`` for a routed model, per executor.

A residual stack of :class:`~condcomp.HeadAttention` layers is routed with ``condcomp.apply_`` (``fixed``
budget s, ``topk`` router, eval mode) and run with every registered executor but those that read a decoder's KV
cache (``kv_cache``: this stack has no cache; ``condcomp bench decode --compile`` times it), plus the unrouted dense
stack; the
gathered executor also at BudgetFormer plans (``budgetformer``: untrained, no declared cap, so its capturable path
computes every head; ``budgetformer_capped``: ``s_max = s`` with ``cap_at_s_max``, k_cap = floor(s * H)) and at MoH's
token plans (``moh``: the ``full`` policy and the ``moh`` router with ``H // 4`` shared heads and top-``H // 4`` routed
heads, half the heads per token; under compile it runs ``token.static``).
For each: whether ``fullgraph=True`` capture succeeds, the graphs and graph breaks ``torch._dynamo.explain``
reports (with the first break reasons), the first-call compile time, the largest difference from eager, and
the median forward time eager vs compiled (inductor), interleaved repetition by repetition because the
machine may be shared. ``--device cuda`` runs it on the GPU (timings synchronised). Writes ``metrics.json`` and
``table.md`` into ``--out``, rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.cli_args import finite_float, integer, output_folder

SHAPE = (16, 256, 512, 8, 2)  # B, T, D, H, layers: the CPU shape of docs/performance.md
QUICK_SHAPE = (4, 32, 64, 8, 1)


class Stack(nn.Module):
    """Residual attention layers with a padding mask (the shape of an encoder without its MLPs)."""

    def __init__(self, D: int, H: int, layers: int) -> None:
        super().__init__()
        from condcomp.attention import HeadAttention

        self.layers = nn.ModuleList([HeadAttention(D, H) for _ in range(layers)])

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x, mask)
        return x


POLICIES = ("fixed", "budgetformer", "budgetformer_capped", "moh")


def router_spec(policy: str, H: int) -> tuple[str, dict[str, Any]]:
    """The router of a benchmark policy name: MoH's for ``moh`` (``H // 4`` shared, top-``H // 4``), else ``topk``."""
    if policy == "moh":
        return "moh", {"shared_heads": max(1, H // 4), "top_k": max(1, H // 4)}
    return "topk", {}


def policy_spec(policy: str, s: float) -> tuple[str, dict[str, Any]]:
    """The config entry of a benchmark policy name (:data:`POLICIES`) at budget fraction ``s``."""
    if policy == "moh":
        return "full", {}
    if policy == "fixed":
        return "fixed", {"fraction": s}
    if policy == "budgetformer":
        return "budgetformer", {}
    if policy == "budgetformer_capped":
        return "budgetformer", {"s_min": min(0.1, s), "s_max": s, "cap_at_s_max": True}
    raise ValueError(f"unknown benchmark policy {policy!r}; policies: {', '.join(POLICIES)}")


def build(executor: str | None, D: int, H: int, layers: int, s: float, seed: int = 0,
          policy: str = "fixed") -> nn.Module:
    """The stack routed with ``executor`` and ``policy`` (:data:`POLICIES`; None executor: the dense, unwrapped
    stack)."""
    import condcomp

    torch.manual_seed(seed)
    model = Stack(D, H, layers)
    if executor is not None:
        cfg = condcomp.CondCompConfig(policy=policy_spec(policy, s), router=router_spec(policy, H), executor=executor)
        condcomp.apply_(model, cfg)
    return model.eval()


def explain(model: nn.Module, x: Tensor, mask: Tensor) -> dict[str, Any]:
    """Graph count, graph breaks and their first reasons (deduplicated) as dynamo sees them."""
    torch._dynamo.reset()
    e = torch._dynamo.explain(model)(x, mask)
    reasons: list[str] = []
    for b in e.break_reasons:
        where = b.user_stack[-1] if b.user_stack else None
        line = b.reason.strip().splitlines()[0][:160]
        text = f"{line} at {Path(where.filename).name}:{where.lineno}" if where is not None else line
        if text not in reasons:
            reasons.append(text)
    return {"graphs": e.graph_count, "graph_breaks": e.graph_break_count, "break_reasons": reasons[:5]}


def fullgraph_ok(model: nn.Module, x: Tensor, mask: Tensor) -> tuple[bool, str]:
    """Whether ``torch.compile(fullgraph=True)`` captures the model (eager backend: no codegen cost)."""
    torch._dynamo.reset()
    try:
        torch.compile(model, fullgraph=True, backend="eager")(x, mask)
        return True, ""
    except Exception as e:  # dynamo raises Unsupported / UserError subclasses; report, never hide
        return False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def _bind(fn: Callable[..., Tensor], x: Tensor, mask: Tensor) -> Callable[[], Tensor]:
    return lambda: fn(x, mask)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_times(fns: dict[str, Callable[[], Tensor]], reps: int,
                  device: torch.device | None = None) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():  # interleaved: a noisy neighbour slows every variant alike
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def variants(executors: list[str] | None = None) -> list[tuple[str, str]]:
    """``(executor, policy)`` rows in order: ``dense``, each of ``executors`` (None: :func:`default_executors`) at
    ``fixed``, then ``gathered`` at the other :data:`POLICIES` when it is among them."""
    for name in executors or ():
        if (why := cache_only(name)) is not None:
            raise ValueError(why)
    names = ["dense", *(executors or default_executors())]
    return [(name, "fixed") for name in names] + [("gathered", p) for p in POLICIES[1:] if "gathered" in names]


def run(quick: bool = False, reps: int = 10, threads: int = 2, s: float = 0.25,
        executors: list[str] | None = None, device: str = "cpu",
        on_record: Callable[[list[dict[str, Any]]], object] | None = None) -> list[dict[str, Any]]:
    """One record per executor (and ``dense``) at the fixed policy, and the gathered executor at BudgetFormer
    and MoH plans; see the module docstring. ``on_record``: called with the records so far after each one (the
    command rewrites its files there: a run stopped by a time limit keeps the rows it finished)."""
    import condcomp

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench compile: --device cuda asked for, but torch sees no CUDA device here; use --device cpu")
    torch.set_num_threads(threads)
    B, T, D, H, layers = QUICK_SHAPE if quick else SHAPE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, T - T // 4:] = torch.rand(B, 1, generator=gen) < 0.5  # half the examples end in padding
    x, mask = x.to(dev), mask.to(dev)
    records = []
    for name, policy in variants(executors):
        model = build(None if name == "dense" else name, D, H, layers, s, policy=policy).to(dev)
        record: dict[str, Any] = {"executor": name, "policy": "-" if name == "dense" else policy, "B": B, "T": T,
                                  "D": D, "H": H, "layers": layers, "s": s, "threads": threads, "reps": reps,
                                  "device": dev.type, "router": "-" if name == "dense" else router_spec(policy, H)[0]}
        record["fullgraph"], record["fullgraph_error"] = fullgraph_ok(model, x, mask)
        record.update(explain(model, x, mask))
        torch._dynamo.reset()
        compiled = torch.compile(model)
        with torch.no_grad():
            want = model(x, mask)
            _sync(dev)
            t0 = time.perf_counter()
            got = compiled(x, mask)
            _sync(dev)
            record["compile_s"] = time.perf_counter() - t0
            record["max_abs_diff"] = float((got - want).abs().max())
            usage = condcomp.head_usage(model)  # the strategy the compiled forward ran (gathered)
            record["strategy"] = ",".join(sorted({u.strategy for u in usage.values() if u.strategy})) or "-"
            for _ in range(2):
                model(x, mask)
                compiled(x, mask)
            fns = {"eager": _bind(model, x, mask), "compiled": _bind(compiled, x, mask)}
            med = _median_times(fns, reps, dev)
        record["eager_ms"], record["compiled_ms"] = med["eager"] * 1e3, med["compiled"] * 1e3
        record["speedup"] = med["eager"] / med["compiled"]
        records.append(record)
        if on_record is not None:
            on_record(records)
        print(f"  {name:10s} {record['policy']:19s} fullgraph={record['fullgraph']!s:5s} graphs={record['graphs']} "
              f"breaks={record['graph_breaks']} eager={record['eager_ms']:.2f} ms "
              f"compiled={record['compiled_ms']:.2f} ms x{record['speedup']:.2f}", flush=True)
    return records


def table(records: list[dict[str, Any]]) -> str:
    """Markdown table of the records (medians; speedup = eager / compiled)."""
    r0 = records[0]
    lines = [f"B={r0['B']} T={r0['T']} D={r0['D']} H={r0['H']} layers={r0['layers']} s={r0['s']}, forward, eval, "
             f"{r0.get('device', 'cpu')}, {r0['threads']} threads, median of {r0['reps']}; moh: the full policy and "
             f"the moh router, {max(1, r0['H'] // 4)} shared heads + top-{max(1, r0['H'] // 4)} routed", "",
             "| executor | policy | strategy (compiled) | fullgraph=True | graphs | breaks | compile (s) | eager (ms) "
             "| compiled (ms) | speedup | max abs diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['executor']} | {r.get('policy', 'fixed')} | {r.get('strategy', '-')} | "
                     f"{'yes' if r['fullgraph'] else 'no'} | {r['graphs']} | "
                     f"{r['graph_breaks']} | {r['compile_s']:.1f} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
                     f"{r['speedup']:.2f} | {r['max_abs_diff']:.1e} |")
    reasons = [(f"{r['executor']} ({r.get('policy', 'fixed')})", reason) for r in records
               for reason in r["break_reasons"]]
    if reasons:
        lines += ["", "Graph breaks:"] + [f"- {e}: {why}" for e, why in reasons]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(records: list[dict[str, Any]]) -> str:  # after every row, so a run cut short keeps what it timed
        (out / "metrics.json").write_text(json.dumps({"benchmark": "compile", "torch": torch.__version__,
                                                       "records": records}, indent=1))
        text = table(records)
        (out / "table.md").write_text(text)
        return text

    records = run(quick=args.quick, reps=args.reps, threads=args.threads, s=args.s, executors=args.executors,
                  device=args.device, on_record=write)
    text = write(records)
    print(text)
    print(f"wrote {out / 'metrics.json'} and {out / 'table.md'}")
    return 0


def cache_only(name: str) -> str | None:
    """Why executor ``name`` has no row here, or None: one that reads a decoder's compact KV cache
    (``capabilities.reads_kv_cache``) would time, on this encoder stack without a cache, a path ``auto`` never runs."""
    from condcomp.executors.auto import get_executor

    if not getattr(getattr(get_executor(name), "capabilities", None), "reads_kv_cache", False):
        return None
    return (f"executor {name!r} reads a decoder's KV cache and this benchmark's stack is an encoder block without one "
            "(its row would time a cache-free path auto never runs); time it with condcomp bench decode --compile")


def default_executors() -> list[str]:
    """Every registered executor that has a row here (:func:`cache_only`)."""
    import condcomp

    return [name for name in condcomp.list_executors() if cache_only(name) is None]


def executor_name(value: str) -> str:
    """An argparse ``type``: a registered executor's name with a row here (checked before any model is built)."""
    import condcomp

    names = condcomp.list_executors()
    if value not in names:
        raise argparse.ArgumentTypeError(f"unknown executor {value!r}; pass registered ones: {', '.join(names)}")
    if (why := cache_only(value)) is not None:
        raise argparse.ArgumentTypeError(why)
    return value


def add_bench_commands(bench_subparsers: Any) -> None:
    """Register ``condcomp bench compile``."""
    p = bench_subparsers.add_parser("compile", help="eager vs torch.compile per executor (graph breaks, speedup)")
    p.add_argument("--out", type=output_folder, required=True, help="directory for metrics.json and table.md")
    p.add_argument("--quick", action="store_true", help=f"tiny shape {QUICK_SHAPE} (smoke test)")
    p.add_argument("--reps", type=integer(at_least=1), default=10,
                   help="timed repetitions per variant (median reported)")
    p.add_argument("--threads", type=integer(at_least=1), default=2, help="torch CPU threads")
    p.add_argument("--s", type=finite_float(above=0, at_most=1), default=0.25,
                   help="head budget fraction of the fixed policy")
    p.add_argument("--executors", nargs="+", type=executor_name, default=None,
                   help="subset of executors (default: every registered but kv_cache, a decoder's, which bench "
                   "decode --compile times)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the models run (cuda: timings synchronised; an error without a CUDA device)")
    p.set_defaults(func=main)
