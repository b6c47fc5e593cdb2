"""``condcomp tune-llm``: continue-tune a causal LM (SmolLM2-135M-Instruct) into routed variants and measure quality
against KV memory, side by side with static pruning (docs/llm.md, "Continue-tuning: quality against KV memory").

The tuning loop is in tuning.py, the study (data, reference, static head sets, variants, summary) in
tuning_study.py, its summary table and plot in tuning_report.py, the variants in variants.py, the measurements in
evaluation.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from condcomp.cli_args import folders_with, integer, option_type, output_folder
from condcomp.experiments.llm.data import LM_DATASETS
from condcomp.experiments.llm.objectives import OBJECTIVES
from condcomp.experiments.llm.tuning import PRESET_ALIASES, PRESETS, TuneSettings

# The range of every numeric TuneSettings field (its declared options), checked when the command line is parsed.
NUMBER_FLAGS: dict[str, Callable[[str], Any]] = {o.name: option_type(o) for o in TuneSettings.options}


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    """Preset < explicit flags."""
    values: dict[str, Any] = dict(PRESETS[PRESET_ALIASES.get(args.preset, args.preset)])
    for f in fields(TuneSettings):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return TuneSettings(**values)


def _cmd_tune_llm(args: argparse.Namespace) -> int:
    import shlex
    import sys

    import torch

    from condcomp.experiments.data import LLM_DATA_ADVICE, resolve_data_dir
    from condcomp.experiments.llm.tuning_report import load_decode_records
    from condcomp.experiments.llm.tuning_study import run_tuning_study

    decode = load_decode_records(args.decode_results) if args.decode_results else None
    if args.report_only:
        from condcomp.experiments.llm.tuning_study import write_summary

        folders = folders_with([args.out, args.results], "*/metrics.json", "--report-only", "tune-llm results")
        for folder in folders:
            print(write_summary(folder, decode))
        return 0
    torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    command = shlex.join(["condcomp", *sys.argv[1:]]) if sys.argv[1:2] == ["tune-llm"] else None
    data_dir = resolve_data_dir(args.data_dir, LLM_DATA_ADVICE)
    table = run_tuning_study(settings, args.variants, args.out, args.results, data_dir, command, decode=decode)
    print(table)
    return 0


def add_commands(sub: Any) -> None:
    """Register ``tune-llm`` on the ``condcomp`` parser."""
    from condcomp.experiments.llm.variants import DEFAULT_ORDER

    p = sub.add_parser("tune-llm", help="continue-tune SmolLM2 into routed / statically pruned variants; "
                       "perplexity, greedy agreement and samples per variant (metrics.json)")
    p.add_argument("--out", type=output_folder, default="runs/llm",
                   help="work folder: OUT/<variant>/checkpoint.pt and metrics.json (default runs/llm)")
    p.add_argument("--results", type=output_folder, default=None,
                   help="also write each metrics.json and the summary table here (e.g. results/llm)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_ORDER), choices=list(DEFAULT_ORDER),
                   help="variants to run, in order (default: all)")
    p.add_argument("--preset", choices=sorted([*PRESETS, *PRESET_ALIASES]), default="default",
                   help="default: the full run (~45 CPU minutes per variant); short: the reduced run (40 steps; "
                        "'session' is its former name)")
    p.add_argument("--report-only", action="store_true",
                   help="only rebuild summary.md/summary.json/ppl_vs_kv.png from the metrics.json files present")
    p.add_argument("--decode-results", type=Path, nargs="+", default=None, metavar="DIR",
                   help="folders of `condcomp bench decode` runs: the table adds decode ms/token x dense and KV MiB "
                        "at their largest prompt and batch, joined by kept KV fraction (e.g. "
                        "results/bench/decode/smollm2_cpu results/bench/decode/smollm2_moh_cpu)")
    p.add_argument("--data-dir", default=None, help="staged datasets (default $CONDCOMP_DATA_DIR, else ../shared/data)")
    p.add_argument("--threads", type=integer(at_least=1), default=1,
                   help="torch threads (default 1: the machine is shared)")
    for f in fields(TuneSettings):
        if f.name == "datasets":
            p.add_argument("--datasets", nargs="+", default=None, choices=list(LM_DATASETS))
            continue
        if f.name == "objective":
            p.add_argument("--objective", default=None, choices=list(OBJECTIVES),
                           help="the tuning loss on continuation tokens: lm (language modelling, default), kl "
                                "(distillation from the dense model's next-token distributions), hidden (its final "
                                "hidden states), lm+kl (weighted by --kl-weight); see docs/tuning.md")
            continue
        numeric = str(f.type) in ("int", "float", "float | None")
        kind: Callable[[str], Any] = NUMBER_FLAGS[f.name] if numeric else str  # a new number needs its range above
        default = "--lr" if f.name == "router_lr" else f.default
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                       help=f"(default {default})")
    p.set_defaults(func=_cmd_tune_llm)
