"""The ``condcomp`` command: demo, train, eval, ablate, report, dit, bench, tune-llm, calibrate-kv, cache.

Each command lives beside the code it drives; a module contributes commands through ``add_commands(sub)``
(top-level commands) or ``add_bench_commands(sub)`` (``condcomp bench NAME``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from condcomp.cli_args import OneLineParser

# Modules that contribute commands, imported only when the command line is built (import condcomp stays light).
COMMAND_MODULES = ("condcomp.experiments.classification.commands", "condcomp.experiments.llm.command",
                   "condcomp.experiments.llm.calibrate_kv",
                   "condcomp.experiments.dit.commands", "condcomp.experiments.llm.model_cache")
BENCH_MODULES = ("condcomp.bench.attention", "condcomp.bench.compile", "condcomp.bench.decode",
                 "condcomp.bench.gpu_check", "condcomp.bench.kv", "condcomp.bench.scatter")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="condcomp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    bench = sub.add_parser("bench", help="side-by-side timing benchmarks (table + metrics.json)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).add_bench_commands(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError) as err:
        # A clear one-line message for the user's mistakes; CONDCOMP_DEBUG=1 keeps the traceback.
        import os

        if os.environ.get("CONDCOMP_DEBUG"):
            raise
        print(f"condcomp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
