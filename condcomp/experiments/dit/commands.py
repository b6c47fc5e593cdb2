"""``condcomp dit``: the DiT study (contributed to condcomp/cli.py through ``add_commands``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from condcomp.cli_args import finite_float, integer, json_object, output_folder
from condcomp.experiments.dit.study import DEFAULT_VARIANTS


def _cmd_dit(args: argparse.Namespace) -> int:
    import torch

    from condcomp.experiments.dit.study import run_dit_study
    from condcomp.experiments.dit.train import DiTRunSettings

    torch.set_num_threads(args.threads)
    overrides = {k: v for k, v in (("preset", args.preset), ("steps", args.steps), ("batch_size", args.batch_size),
                                   ("lr", args.lr), ("budget_cost", args.budget_cost),
                                   ("samples_per_class", args.samples_per_class),
                                   ("sample_steps", args.sample_steps), ("guidance", args.guidance),
                                   ("executor", args.executor)) if v is not None}
    if args.model:
        overrides["model"] = args.model
    settings = DiTRunSettings.from_dict(overrides)
    command = shlex.join(["condcomp", *sys.argv[1:]]) if sys.argv[1:2] == ["dit"] else None
    if not args.plots_only:
        run_dit_study(args.out, list(args.seeds), list(args.variants), settings, command, args.data, args.device,
                      args.checkpoint_every)
    if not args.no_plots:
        from condcomp.experiments.dit.plots import write_plots

        for path in write_plots(args.out):
            print(f"wrote {path}")
    print(f"summary: {args.out / 'summary.json'}")
    return 0


def add_commands(sub: Any) -> None:
    """Register ``dit`` on the ``condcomp`` parser."""
    p = sub.add_parser("dit", help="class-conditional DiT on digits: dense vs MoH vs a noise-aware learned budget vs "
                       "fixed top-k; Fréchet distance, class accuracy, heads per noise level (resumable)")
    p.add_argument("--out", type=output_folder, default=Path("results/dit"),
                   help="study folder: OUT/seed<S>/<variant>/metrics.json, OUT/summary.json, OUT/plots")
    p.add_argument("--seeds", type=integer(at_least=0), nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                   help=f"default {' '.join(DEFAULT_VARIANTS)}; also budgetformer (no timestep input)")
    p.add_argument("--preset", default=None, help="digits (8x8, default) | digits16 (upsampled) | cifar (GPU shape)")
    p.add_argument("--model", type=json_object, default=None,
                   help='JSON overrides of the preset\'s shape, e.g. \'{"num_layers": 6}\'')
    p.add_argument("--steps", type=integer(at_least=1), default=None, help="training steps per run (default 500)")
    p.add_argument("--batch-size", type=integer(at_least=1), default=None)
    p.add_argument("--lr", type=finite_float(above=0), default=None)
    p.add_argument("--budget-cost", type=finite_float(at_least=0), default=None,
                   help="price on heads for the learned budgets")
    p.add_argument("--samples-per-class", type=integer(at_least=1), default=None,
                   help="generated images per class (default 30)")
    p.add_argument("--sample-steps", type=integer(at_least=1), default=None,
                   help="Euler steps of the sampler (default 20)")
    p.add_argument("--guidance", type=finite_float(at_least=0), default=None,
                   help="classifier-free guidance scale (default 2)")
    p.add_argument("--executor", default=None, help="auto | masked | gathered | reference (routed variants)")
    p.add_argument("--data", type=Path, default=None,
                   help="an .npz image set instead of scikit-learn's digits (train_images, train_labels, test_images, "
                   "test_labels; uint8 images), e.g. CIFAR-10 with --preset cifar (docs/dit.md)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=integer(at_least=1), default=1,
                   help="torch threads (default 1: the runs are small)")
    p.add_argument("--checkpoint-every", type=integer(at_least=1), default=50,
                   help="training steps between a run's checkpoints (a stopped study resumes from the last)")
    p.add_argument("--plots-only", action="store_true", help="only redraw the plots from OUT's records")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=_cmd_dit)
