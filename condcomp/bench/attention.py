"""``condcomp bench attention``: dense vs k-head oracle vs masked vs gathered, side by side, in one run.

One attention block (QKV projection + attention + output projection) is timed four ways, forward and
forward+backward, at budgets s in {0.125, 0.25, 0.5, 0.75, 1.0}:

- ``dense``: all H heads as ``torch.nn.MultiheadAttention`` computes them (one fused QKV matmul, SDPA, out proj);
- ``oracle``: the same block built with only k = round(s * H) heads: the floor for computing k of H heads;
- ``masked``: condcomp's ``masked`` executor (all heads, then gates: what MoH's released code does);
- ``gathered``: condcomp's ``gathered`` executor (only the selected heads).

``masked`` and ``gathered`` include the routing: a linear head scorer and top-k (sequence plans, one head set per
example with k drawn per example around s * H, mean s * H) or MoH-style per-token routing (token plans: the
first ``n // 2`` heads shared, top-``(n - n // 2)`` of the others per token, n = round(s * H)). Variants are
interleaved repetition by repetition (the machine may be shared and noisy) and the median is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from condcomp.cli_args import integer, output_folder
from condcomp.executors.auto import get_executor
from condcomp.plans import plan_from_active, plan_top_k, top_k_mask
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout, HeadPlan

BUDGETS = (0.125, 0.25, 0.5, 0.75, 1.0)
SHAPES = {  # (B, T, D, H)
    "cpu": ((16, 256, 512, 8), (32, 128, 256, 8)),
    "cuda": ((64, 512, 768, 12), (8, 2048, 2048, 32)),
}
QUICK_SHAPES = ((2, 16, 64, 8),)
VARIANTS = ("dense", "oracle", "masked", "gathered")
PASSES = ("fwd", "fwd+bwd")
# Settings outside the code that change the timings, recorded in every record: libgomp's wait policy and glibc's
# malloc thresholds (docs/performance.md).
ENVIRONMENT = ("OMP_WAIT_POLICY", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


@dataclass
class Block:
    """A dense attention block's parameters, stored fused as in ``nn.MultiheadAttention``."""

    in_w: Tensor  # (3 * H * Dh, D)
    in_b: Tensor  # (3 * H * Dh,)
    out_w: Tensor  # (D, H * Dh)
    out_b: Tensor  # (D,)
    heads: int

    @staticmethod
    def random(D: int, H: int, Dh: int, device: torch.device, dtype: torch.dtype) -> Block:
        def p(*shape: int) -> Tensor:
            return (torch.randn(*shape, device=device) * shape[-1] ** -0.5).to(dtype).requires_grad_()

        return Block(p(3 * H * Dh, D), p(3 * H * Dh), p(D, H * Dh), p(D), H)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, T, D)``: fused QKV projection, SDPA, output projection."""
        B, T, _ = x.shape
        Dh = self.in_w.shape[0] // (3 * self.heads)
        qkv = F.linear(x, self.in_w, self.in_b).view(B, T, 3, self.heads, Dh).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (B, h, T, Dh)
        return F.linear(out.transpose(1, 2).reshape(B, T, -1), self.out_w, self.out_b)

    def weights(self) -> AttentionWeights:
        """Views of the fused parameters in condcomp's canonical layout (what the adapters hand executors)."""
        HD = self.in_w.shape[0] // 3
        D = self.out_w.shape[0]
        layout = HeadLayout(D, self.heads, self.heads, HD // self.heads, (HD // self.heads) ** -0.5)
        w, b = self.in_w, self.in_b
        return AttentionWeights(layout, w[:HD], w[HD:2 * HD], w[2 * HD:], self.out_w,
                                b[:HD], b[HD:2 * HD], b[2 * HD:], self.out_b)

    def parameters(self) -> list[Tensor]:
        return [self.in_w, self.in_b, self.out_w, self.out_b]


def draw_ks(B: int, k: int, H: int, gen: torch.Generator) -> Tensor:
    """Per-example head counts spread evenly over ``k - d .. k + d`` (d <= 1, kept inside [1, H]), mean ~k."""
    d = min(1, k - 1, H - k)
    cycle = torch.arange(-d, d + 1).repeat(B // (2 * d + 1) + 1)[:B]
    return (k + cycle[torch.randperm(B, generator=gen)]).long()


def make_router(granularity: str, D: int, H: int, n: int, ks: Tensor, device: torch.device) -> Callable:
    """The routing step timed with masked/gathered: scores from a linear layer (float32) and top-k."""
    shared = n // 2 if granularity == "token" else 0
    scorer = torch.nn.Linear(D, H - shared, bias=False).to(device)
    k_cap = int(ks.max()) if granularity == "sequence" else None  # the bound a policy declares: read once, here

    def sequence(x: Tensor) -> HeadPlan:
        scores = scorer(x.float().mean(1))  # (B, H)
        return plan_top_k(scores, ks, gates="weighted", k_cap=k_cap)

    def token(x: Tensor) -> HeadPlan:
        scores = scorer(x.float())  # (B, T, H - shared)
        routed = top_k_mask(scores, n - shared)
        active = torch.cat([torch.ones(*scores.shape[:2], shared, dtype=torch.bool, device=device), routed], -1)
        probs = torch.softmax(scores, -1) * (n - shared)
        gates = torch.cat([torch.ones_like(probs[..., :shared]), probs], -1)
        return plan_from_active(active, gates, k_cap=n, shared_heads=shared)  # declared: n heads, shared first

    return sequence if granularity == "sequence" else token


def variants(dense: Block, oracle: Block, x: Tensor, router: Callable) -> dict[str, Callable[[], Tensor]]:
    """The four timed callables; masked and gathered include the routing."""
    w = dense.weights()
    masked, gathered = get_executor("masked"), get_executor("gathered")
    return {
        "dense": lambda: dense.forward(x),
        "oracle": lambda: oracle.forward(x),
        "masked": lambda: masked(w, AttentionInputs(x=x), router(x)),
        "gathered": lambda: gathered(w, AttentionInputs(x=x), router(x)),
    }


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is unavailable, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_group(fns: dict[str, Callable[[], Tensor]], passes: tuple[str, ...], reps: int, warmup: int,
               device: torch.device, inputs: list[Tensor]) -> dict[tuple[str, str], tuple[list[float], float]]:
    """Every repetition's milliseconds and the median minor page faults of every (variant, pass), variants
    interleaved within each repetition. Page faults are recorded because glibc's malloc may hand freed memory back
    to the OS between calls; a call that then touches fresh pages pays for them."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[tuple[str, str], list[float]] = {(v, p): [] for v in fns for p in passes}
    faults: dict[tuple[str, str], list[int]] = {(v, p): [] for v in fns for p in passes}
    for rep in range(warmup + reps):
        for pas in passes:
            for name, fn in fns.items():
                sync()
                f0, t0 = _minor_faults(), time.perf_counter()
                if pas == "fwd":
                    with torch.no_grad():
                        fn()
                else:
                    y = fn()
                    y.backward(torch.ones_like(y))
                sync()
                if rep >= warmup:
                    times[(name, pas)].append((time.perf_counter() - t0) * 1e3)
                    faults[(name, pas)].append(_minor_faults() - f0)
                for t in inputs:
                    t.grad = None
    return {key: (v, statistics.median(faults[key])) for key, v in times.items()}


def paired_ratio(times: list[float], base: list[float]) -> float:
    """Median over repetitions of ``times[i] / base[i]``: both were timed in the same repetition, seconds apart,
    so a machine that speeds up or slows down between repetitions moves both (the ratio of the two medians does
    not pair them)."""
    return statistics.median(t / b for t, b in zip(times, base))


def run(device_name: str, quick: bool = False, reps: int | None = None, threads: int = 2,
        passes: tuple[str, ...] = PASSES, budgets: tuple[float, ...] = BUDGETS,
        granularities: tuple[str, ...] = ("sequence", "token"),
        shapes: tuple[tuple[int, int, int, int], ...] | None = None) -> list[dict[str, Any]]:
    """Time every shape x budget x granularity x variant x pass; returns the ``metrics.json`` records."""
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False; use --device cpu")
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES[device.type])
    budgets = (0.25, 1.0) if quick and budgets == BUDGETS else budgets
    reps = reps or (2 if quick else 9)
    gen = torch.Generator().manual_seed(0)
    records: list[dict[str, Any]] = []
    for B, T, D, H in shapes:
        Dh = D // H
        torch.manual_seed(0)
        dense = Block.random(D, H, Dh, device, dtype)
        x = torch.randn(B, T, D, device=device, dtype=dtype).requires_grad_()
        for granularity in granularities:
            for s in budgets:
                n = max(1, round(s * H))
                oracle = Block.random(D, n, Dh, device, dtype)
                ks = draw_ks(B, n, H, gen).to(device)
                router = make_router(granularity, D, H, n, ks, device)
                fns = variants(dense, oracle, x, router)
                leaves = [x, *dense.parameters(), *oracle.parameters()]
                timed = time_group(fns, passes, reps, 1 if quick else 2, device, leaves)
                for (variant, pas), (reps_ms, faults) in timed.items():
                    records.append({"shape": {"B": B, "T": T, "D": D, "H": H}, "s": s, "granularity": granularity,
                                    "variant": variant, "pass": pas, "ms": round(statistics.median(reps_ms), 3),
                                    "k": n, "ms_reps": [round(t, 3) for t in reps_ms],
                                    "paired_to_dense": round(paired_ratio(reps_ms, timed[("dense", pas)][0]), 4),
                                    "paired_to_oracle": round(paired_ratio(reps_ms, timed[("oracle", pas)][0]), 4),
                                    "minor_faults": faults, "device": device.type,
                                    "dtype": str(dtype).replace("torch.", ""), "threads": threads,
                                    **{env.lower().rstrip("_"): os.environ.get(env, "") for env in ENVIRONMENT}})
                print(f"  B={B} T={T} D={D} H={H} {granularity:8s} s={s:<5} " + "  ".join(
                    f"{v}/{p}={statistics.median(timed[(v, p)][0]):.1f}ms" for p in passes for v in VARIANTS),
                    flush=True)
    return records


def table(records: list[dict[str, Any]]) -> str:
    """Markdown table: one row per shape x granularity x s x pass, times and ratios (medians), gathered's paired
    ratios (median of per-repetition ratios, ``paired_ratio``), and the median minor page faults per call of each
    variant (dense / oracle / masked / gathered)."""
    rows: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        sh = r["shape"]
        key = (sh["B"], sh["T"], sh["D"], sh["H"], r["granularity"], r["pass"], r["s"])
        rows.setdefault(key, {})[r["variant"]] = r
    lines = ["| shape | granularity | pass | s | dense ms | oracle ms | masked ms | gathered ms "
             "| oracle/dense | masked/dense | gathered/dense | gathered/oracle | paired g/d | paired g/o "
             "| page faults d/o/m/g |",
             "|" + "---|" * 15]
    nan = float("nan")
    for (B, T, D, H, gran, pas, s), v in rows.items():
        d, o, m, g = (v[n]["ms"] if n in v else nan for n in VARIANTS)
        pd, po = (v.get("gathered", {}).get(f"paired_to_{n}", nan) for n in ("dense", "oracle"))
        faults = "/".join(str(round(v[n].get("minor_faults", 0))) if n in v else "-" for n in VARIANTS)
        lines.append(f"| B={B} T={T} D={D} H={H} | {gran} | {pas} | {s} | {d:.1f} | {o:.1f} | {m:.1f} | {g:.1f} "
                     f"| {o / d:.2f} | {m / d:.2f} | {g / d:.2f} | {g / o:.2f} | {pd:.2f} | {po:.2f} | {faults} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``condcomp bench attention``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passes = PASSES if args.passes == "both" else (args.passes,)
    records = run(args.device, quick=args.quick, reps=args.reps, threads=args.threads, passes=passes)
    (out / "metrics.json").write_text(json.dumps(records, indent=1))
    text = table(records)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'metrics.json'} and {out / 'table.md'}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=output_folder, required=True, help="directory for metrics.json and table.md")
    parser.add_argument("--quick", action="store_true", help="one tiny shape, s in {0.25, 1.0}, 2 repetitions")
    parser.add_argument("--reps", type=integer(at_least=1), default=None,
                        help="timed repetitions per variant (default 9)")
    parser.add_argument("--threads", type=integer(at_least=1), default=2, help="torch.set_num_threads (CPU)")
    parser.add_argument("--passes", choices=("fwd", "fwd+bwd", "both"), default="both")


def add_bench_commands(bench_subparsers: Any) -> None:
    """Register ``condcomp bench attention``."""
    p = bench_subparsers.add_parser("attention", help="dense vs oracle vs masked vs gathered attention timing")
    add_arguments(p)
    p.set_defaults(func=main)
