"""``condcomp bench scatter``: native scatter-adds (``index_add_``, ``scatter_add_``) against torch-scatter on the
gathered executor's shapes.

The gathered executor sums packed rows back into their tokens or examples with native ``index_add_`` /
``scatter_add_``. It would take torch-scatter, as an optional dependency, only where that measurably wins; this
benchmark is the measurement (it does not: docs/performance.md, "Scatter"). torch-scatter has no wheels for current
torch, so build it first (about 10 minutes on 2 cores):

    pip install --no-build-isolation torch-scatter
    condcomp bench scatter --out results/bench/scatter/cpu

Every variant is checked against a float64 ``index_add`` before it is timed. The variants are interleaved within each
of ``--reps`` repetitions; a time is the median over them, each call including a clone of the destination (timed
alone as ``clone``), and the whole is repeated ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from condcomp.bench.attention import time_group
from condcomp.cli_args import integer, output_folder


def cases(gen: torch.Generator) -> list[tuple[str, Tensor, Tensor, Tensor]]:
    """``(name, destination, index, source)``: destination rows ``index[i]`` receive ``source[i]``."""
    def rows(n: int, d: int) -> Tensor:
        return torch.randn(n, d, generator=gen)

    B, T, D = 16, 256, 512
    pairs = torch.sort(torch.randint(0, B, (64,), generator=gen)).values
    return [
        # token plans per head set: every token with a routed head once (a permutation of B*T rows)
        ("token, per head set: B*T rows, each once", rows(B * T, D), torch.randperm(B * T, generator=gen),
         rows(B * T, D)),
        # token plans per head: two (token, head) pairs per token
        ("token, per head: 2*B*T rows, each token twice", rows(B * T, D),
         torch.randperm(2 * B * T, generator=gen) % (B * T), rows(2 * B * T, D)),
        # sequence plans, one matmul per pair: 64 pairs' (T, D) outputs into their examples
        ("sequence, per pair: 64 x (T, D) into B examples", torch.randn(B, T, D, generator=gen), pairs,
         torch.randn(64, T, D, generator=gen)),
    ]


def variants(dest: Tensor, index: Tensor, src: Tensor) -> dict[str, Callable[[], Tensor]]:
    """The timed calls of one case; each clones the destination first (the executor adds into a fresh tensor)."""
    import torch_scatter  # optional: see the module docstring

    expanded = index.view(-1, *[1] * (src.dim() - 1)).expand_as(src)
    return {
        "index_add_": lambda: dest.clone().index_add_(0, index, src),
        "scatter_add_": lambda: dest.clone().scatter_add_(0, expanded, src),
        "torch_scatter.scatter": lambda: torch_scatter.scatter(src, index, dim=0, out=dest.clone(), reduce="sum"),
        "clone": lambda: dest.clone(),
    }


def run(reps: int, rounds: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    records: list[dict[str, object]] = []
    for name, dest, index, src in cases(gen):
        calls = variants(dest, index, src)
        expect = dest.double().index_add(0, index, src.double())
        for variant, fn in calls.items():
            if variant != "clone" and not torch.allclose(fn().double(), expect, atol=1e-4):
                raise AssertionError(f"{variant} disagrees with the float64 reference on {name!r}")
        # variants interleaved within each repetition (the attention benchmark's timer), medians per round
        medians = [{v: statistics.median(times) for (v, _), (times, _) in
                    time_group(calls, ("fwd",), reps, 5, torch.device("cpu"), []).items()} for _ in range(rounds)]
        records += [{"case": name, "variant": v, "ms": [round(m[v], 3) for m in medians],
                     "threads": torch.get_num_threads()} for v in calls]
    return records


def table(records: list[dict[str, object]]) -> str:
    lines = ["| case | variant | ms (median per round) |", "|---|---|---|"]
    lines += [f"| {r['case']} | {r['variant']} | {', '.join(f'{t:.2f}' for t in r['ms'])} |"  # type: ignore[attr-defined]
              for r in records]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=output_folder, required=True, help="folder for metrics.json")
    parser.add_argument("--reps", type=integer(at_least=1), default=41, help="interleaved repetitions per round")
    parser.add_argument("--rounds", type=integer(at_least=1), default=3, help="rounds, each reporting its medians")
    parser.add_argument("--threads", type=integer(at_least=1), default=2, help="torch CPU threads")


def main(args: argparse.Namespace | None = None) -> int:
    """Entry point of ``condcomp bench scatter`` and ``python -m condcomp.bench.scatter``."""
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args()
    try:
        import torch_scatter  # noqa: F401
    except ImportError:
        print("torch-scatter is not installed: pip install --no-build-isolation torch-scatter (compiles for about "
              "10 minutes; there are no wheels for current torch)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    records = run(args.reps, args.rounds)
    print(table(records))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(records, indent=1) + "\n")
    return 0


def add_bench_commands(bench_subparsers: Any) -> None:
    """Register ``condcomp bench scatter``."""
    p = bench_subparsers.add_parser("scatter", help="native scatter-adds vs torch-scatter on the gathered "
                                    "executor's shapes (needs torch-scatter built from source)")
    add_arguments(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(main())
