"""``condcomp demo | train | eval | ablate | report`` (contributed to condcomp/cli.py through ``add_commands``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from condcomp.cli_args import (
    component,
    finite_float,
    integer,
    json_object,
    json_object_file,
    output_file,
    output_folder,
    read_json_object,
)
from condcomp.experiments.classification.ablation import CONTROLS, DEFAULT_ARMS, LAYER_ARMS
from condcomp.experiments.classification.runconfig import RunConfig

# RunConfig fields exposed as flags: (type, help). Lists take several values; dicts are JSON strings.
_HELP = {
    "dataset": "ag_news | dbpedia_14 | imdb | snli | yelp | digits (a ViT) | synthetic | files | hf:<name>",
    "data_dir": "folder of the staged datasets (default $CONDCOMP_DATA_DIR, then ../shared/data)",
    "method": "standard | budgetformer | fixed | moh | random",
    "method_options": 'JSON kwargs of the method, e.g. \'{"fraction": 0.25}\' or \'{"s_min": 0.1, "s_max": 0.5}\'',
    "tokenizer": "bert (bert-base-uncased WordPiece, offline) | trained (WordPiece fitted on the train split)",
    "preset": "tiny | small | medium | paper (shape; --d-model etc. override)",
    "max_train": "subsample the training rows (seeded)", "max_test": "subsample the test rows (seeded)",
    "budget_cost": "extra loss budget_cost * mean(s): a price on heads (0 = the paper's objective)",
    "budget_target": "extra loss budget_target * mean((s - t)^2), t from each example's loss rank in its batch "
                     "mapped onto the budget interval: harder examples asked for more heads (0 = off)",
    "threads": "torch threads (1 is far faster when the machine is shared)",
    "checkpoint_every": "save a checkpoint every N steps (0: only at the end)",
    "carbon_country": "ISO-3 country code: measure gCO2 with codecarbon's offline tracker (extra 'carbon')",
}


# The range of every numeric RunConfig field, checked when the command line is parsed.
NUMBER_FLAGS: dict[str, Callable[[str], Any]] = {
    "max_len": integer(at_least=1), "max_train": integer(at_least=1), "max_test": integer(at_least=1),
    "test_seed": integer(at_least=0), "synthetic_train": integer(at_least=1), "synthetic_test": integer(at_least=1),
    "synthetic_len": integer(at_least=1), "d_model": integer(at_least=1), "num_layers": integer(at_least=1),
    "num_heads": integer(at_least=1), "d_ff": integer(at_least=1), "dropout": finite_float(at_least=0, below=1),
    "budget_cost": finite_float(at_least=0), "budget_target": finite_float(at_least=0),
    "epochs": integer(at_least=1), "max_steps": integer(at_least=1), "batch_size": integer(at_least=1),
    "lr": finite_float(above=0), "weight_decay": finite_float(at_least=0),
    "warmup": finite_float(at_least=0, at_most=1),
    "seed": integer(at_least=0), "eval_batch_size": integer(at_least=1), "latency_reps": integer(at_least=1),
    "checkpoint_every": integer(at_least=0), "threads": integer(at_least=1),
}


def _add_run_flags(p: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    p.add_argument("--config", type=json_object_file,
                   help="JSON file of run settings, an object (flags given explicitly win)")
    for f in fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"default": None, "dest": f.name, "help": _HELP.get(f.name)}
        if f.type in ("bool",):
            kw["action"] = "store_true"
        elif f.name in ("train_file", "test_file"):
            kw["nargs"] = "+"
        elif f.name == "method_options":
            kw["type"] = json_object
        elif "int" in str(f.type) or "float" in str(f.type):
            kw["type"] = NUMBER_FLAGS[f.name]  # a new numeric field needs its range here
        p.add_argument(flag, **kw)
    if defaults:
        p.set_defaults(**{f"_default_{k}": v for k, v in defaults.items()})


def run_config(args: argparse.Namespace, base: dict[str, Any] | None = None) -> RunConfig:
    """Defaults < ``base`` < ``--config`` file < explicit flags."""
    d: dict[str, Any] = dict(base or {})
    if getattr(args, "config", None):
        try:
            d.update(read_json_object(args.config))
        except ValueError as err:
            raise ValueError(f"--config: {err}") from None
    for f in fields(RunConfig):
        v = getattr(args, f.name, None)
        if v is not None and v is not False:
            d[f.name] = v
    return RunConfig.from_dict(d)


def with_components(cfg: RunConfig, args: argparse.Namespace) -> tuple[RunConfig, str | None]:
    """``cfg`` with ``--router``/``--policy`` (a user's component) in its method options, where the run records
    them, and the run's name (``fixed+router_norm``; None: the method's own)."""
    given: dict[str, str] = {role: getattr(args, role) for role in ("policy", "router") if getattr(args, role, None)}
    if not given:
        return cfg, None
    from condcomp.experiments.classification.user_components import arm_name

    cfg = RunConfig.from_dict({**cfg.to_dict(), "method_options": {**cfg.method_options, **given}})
    return cfg, "+".join([cfg.method, *(arm_name(role, spec) for role, spec in given.items())])


def _add_component_flags(p: argparse.ArgumentParser) -> None:
    for role, replaces in (("router", "the method's head scorer (topk for fixed and budgetformer)"),
                           ("policy", "the method's budget policy (fixed for fixed, budgetformer for budgetformer)")):
        p.add_argument(f"--{role}", type=component(role), default=None,
                       help=f"your own {role} in place of {replaces}: a registered name or module:Class "
                       "(imported from the current folder or PYTHONPATH); see docs/extending.md")


def _threads(n: int | None) -> None:
    """``n`` torch threads; unset: one thread when the machine is already busy (load >= cores), where several
    threads spin against other jobs and run many times slower (measured: 10-40x on 2 shared cores)."""
    import os

    import torch

    if n:
        torch.set_num_threads(n)
    elif hasattr(os, "getloadavg") and os.getloadavg()[0] >= (os.cpu_count() or 1):
        torch.set_num_threads(1)


def _cmd_demo(args: argparse.Namespace) -> int:
    from condcomp.experiments.classification.demo import run_demo

    _threads(args.threads or 1)  # one thread unless asked: the accuracies then repeat from run to run
    run_demo(args.out, seed=args.seed, quick=args.quick)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from condcomp.experiments.classification.metrics_report import markdown_table, rows_of
    from condcomp.experiments.classification.runner import run_single

    cfg, name = with_components(run_config(args), args)
    _threads(cfg.threads)
    metrics, _ = run_single(cfg, args.out, resume=args.resume, name=name)
    print(markdown_table(rows_of(metrics, cfg.method)))
    print(f"wrote {args.out / 'metrics.json'} and the checkpoint {args.out / 'checkpoint'}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from condcomp.experiments.classification.metrics_report import markdown_table, rows_of
    from condcomp.experiments.classification.runner import eval_checkpoint

    overrides = {k: v for k, v in (("data_dir", args.data_dir), ("max_test", args.max_test),
                                   ("threads", args.threads)) if v is not None}
    _threads(args.threads)
    metrics = eval_checkpoint(args.checkpoint, args.out, overrides)
    print(markdown_table(rows_of(metrics, metrics["method"])))
    print(f"wrote {args.out / 'metrics.json'}")
    return 0


def _cmd_ablate(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from condcomp.experiments.classification.ablation import AblationPlan, run_ablation_study
    from condcomp.experiments.classification.metrics_report import markdown_table

    cfg = run_config(args)
    _threads(cfg.threads)
    plan = AblationPlan(arms=tuple(args.arms), sweep_fractions=tuple(args.sweep_fractions),
                     budget_costs=tuple(args.budget_costs), moh_topk=tuple(args.moh_topk),
                     moh=args.moh or {}, router_arms=tuple(args.router_arms),
                     policy_arms=tuple(args.policy_arms),
                     budgetformer=cfg.method_options if cfg.method == "budgetformer" else {},
                     share_router=args.share_router_schedule)
    seeds = list(args.seeds) if args.seeds else [cfg.seed]
    summary = args.summary or args.out / "summary.json"
    command = shlex.join(["condcomp", *sys.argv[1:]]) if sys.argv[1:2] == ["ablate"] else None
    records = run_ablation_study(cfg, args.out, seeds, plan, summary, command)
    rows = {f"seed{r['seed']}/{r['arm']}": {"accuracy": r["accuracy"], "s_mean": r["s_mean"], "k_frac": r["heads"],
                                            "flop_frac": r["flop_fraction"], "latency_b1": r["latency_b1_s"],
                                            "latency_b64": r["latency_b64_s"],
                                            "peak_mem_b64": r["peak_inference_memory_b64_bytes"],
                                            "train_seconds": r["train_seconds"]} for r in records}
    print(markdown_table(rows))
    print(f"wrote {summary} and {summary.parent / 'statistics.json'}; runs under {args.out / cfg.dataset}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from condcomp.experiments.classification.metrics_report import render_metrics_report

    studies = [p for p in args.metrics if p.is_dir() and (p / "summary.json").is_file()]
    if studies:
        from condcomp.experiments.classification.study_page import render_study_page

        if len(args.metrics) > 1:
            raise ValueError("report: a study folder (with summary.json) is reported on its own")
        print(render_study_page(studies[0], args.doc, plots=not args.no_plots))
        if args.doc:
            print(f"wrote {args.doc} (plots in {studies[0] / 'plots'})")
        return 0
    if args.doc:
        raise ValueError("report: --doc needs a study folder holding summary.json")
    print(render_metrics_report(args.metrics, args.out, plots=not args.no_plots))
    return 0


def add_commands(sub: Any) -> None:
    """Register demo, train, eval, ablate and report on the ``condcomp`` parser."""
    p = sub.add_parser("demo", help="standard vs BudgetFormer vs fixed top-k vs MoH on the embedded synthetic task")
    p.add_argument("--out", type=output_folder, default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--seed", type=integer(at_least=0), default=0)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke version (tiny model, few examples)")
    p.add_argument("--threads", type=integer(at_least=1), default=None,
                   help="torch threads (default 1: another count changes float rounding, and MoH's hard per-token "
                   "choices turn that into other accuracies)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("train", help="train one method on one dataset; metrics.json + checkpoint in --out")
    _add_run_flags(p)
    p.add_argument("--out", type=output_folder, required=True)
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint (model, optimiser, step)")
    _add_component_flags(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint on its run's test split; metrics.json in --out")
    p.add_argument("checkpoint", type=Path, help="a checkpoint folder written by train/ablate")
    p.add_argument("--out", type=output_folder, required=True)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--max-test", type=integer(at_least=1), default=None)
    p.add_argument("--threads", type=integer(at_least=1), default=None)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("ablate", help="the budget vs fixed top-k study on one dataset: every arm for every seed, "
                       "resumable, one summary.json of records + statistics.json")
    _add_run_flags(p)
    p.add_argument("--out", type=output_folder, required=True,
                   help="run folders: OUT/DATASET/seedK/ARM (keep them: reuse and the paired tests read them)")
    p.add_argument("--seeds", type=integer(at_least=0), nargs="+", default=None, help="seeds to run (default: --seed)")
    p.add_argument("--summary", type=output_file, default=None,
                   help="summary JSON (a list of records) to add finished runs to (default OUT/summary.json); "
                   "statistics.json is written beside it")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help=f"arms to run (default {' '.join(DEFAULT_ARMS)}); also "
                   f"{' '.join(a for a in LAYER_ARMS + CONTROLS if a not in DEFAULT_ARMS)}")
    p.add_argument("--share-router-schedule", action="store_true",
                   help="fixed_matched and fixed_per_layer train with BudgetFormer's router_options (from "
                   "--method-options), so they differ from it only in the budget")
    p.add_argument("--sweep-fractions", type=finite_float(above=0, at_most=1), nargs="*", default=[],
                   help="fixed top-k fractions trained as arms fixed_<f> (1 = the standard arm)")
    p.add_argument("--budget-costs", type=finite_float(at_least=0), nargs="*", default=[],
                   help="extra BudgetFormer arms budgetformer_cost<c> with a price c * mean(s) on heads")
    p.add_argument("--moh-topk", type=integer(at_least=0), nargs="*", default=[],
                   help="extra MoH arms moh_k<K> with another K")
    p.add_argument("--moh", type=json_object, default=None,
                   help='JSON options of the MoH arms, e.g. \'{"shared_heads": 2, "top_k": 2}\'')
    p.add_argument("--router-arms", type=component("router"), nargs="*", default=[],
                   help="your routers as arms router_<key> (a registered name or module:Class): fixed top-k's "
                   "budget (the matched fraction, else half the heads) with your router choosing the heads")
    p.add_argument("--policy-arms", type=component("policy"), nargs="*", default=[],
                   help="your budget policies as arms policy_<key> (a registered name or module:Class), heads "
                   "chosen by the topk scorer as in the budgetformer arm")
    p.set_defaults(func=_cmd_ablate)

    p = sub.add_parser("report", help="markdown table (+ plots) from metrics.json files or run folders, or the "
                       "results page of a study folder holding summary.json")
    p.add_argument("metrics", type=Path, nargs="+")
    p.add_argument("--out", type=output_folder, default=None, help="write report.md and plots here")
    p.add_argument("--doc", type=output_file, default=None,
                   help="study folder (summary.json): write the results page here (e.g. docs/results.md); "
                   "plots go to FOLDER/plots")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=_cmd_report)
