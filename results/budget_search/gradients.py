"""What pulls on a trained BudgetFormer's budget s, per example: the task loss's gradient dL_i/ds_i in each layer
(training mode: the straight-through soft top-k that carries it, the router's noise at the end of its schedule)
against the loss terms that treat every example alike (the hinge: 0 inside its interval; the price on heads:
c / layers per example).

For a budget that differs between inputs the per-example pull must differ between inputs in a way the budget
network can predict from what it sees (the mean-pooled input of its layer). Printed per layer: the mean and sd
of dL_i/ds_i over examples, the share of examples whose pull is towards more heads (negative gradient), the
share of examples with no pull at all (the soft mask saturated: the gradient is exactly 0), the Spearman
correlation of the pull and of s with the standard model's loss (difficulty) on the same examples, and the mean
pull per difficulty quintile.

    python results/budget_search/gradients.py RUN_DIR [STANDARD_RUN_DIR] [--batches 20] [--save FILE.json]
        [--max-test N --test-seed S]   # evaluate on the standard run's test subsample

collect.py adds every results/budget_search/gradients_*.json to search.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import condcomp
from condcomp.api import routed_modules
from condcomp.checkpoint import load_checkpoint, read_checkpoint_config
from condcomp.experiments import stats as S
from condcomp.experiments.classification.batches import on_device
from condcomp.experiments.classification.model import ModelConfig
from condcomp.experiments.classification.runconfig import RunConfig, prepare
from condcomp.experiments.classification.train import build_model


def pulls(run: Path, batches: int, batch_size: int = 64, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = read_checkpoint_config(run / "checkpoint")
    cfg = RunConfig.from_dict({**meta["run"], **(overrides or {})})
    prep, _ = prepare(cfg)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(meta["model"]), cfg)
    load_checkpoint(run / "checkpoint", model)
    condcomp.set_progress(model, 1.0)
    model.train()
    routed = routed_modules(model)
    captured: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def fn(_m: Any, _a: Any, out: Any) -> None:
            out.s.retain_grad()
            captured[name] = out.s
        return fn

    handles = [r.condcomp_policy.register_forward_hook(hook(n)) for n, r in routed.items()]
    grads: dict[str, list[float]] = {n: [] for n in routed}
    s_vals: dict[str, list[float]] = {n: [] for n in routed}
    for i, batch in enumerate(prep.test.batches(batch_size)):
        if i >= batches:
            break
        ids, mask, seg, labels = on_device(batch, torch.device("cpu"))
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids, mask, seg), labels, reduction="sum")  # sum: d/ds_i = dL_i/ds_i
        loss.backward()
        for n in routed:
            grads[n] += captured[n].grad.float().tolist()
            s_vals[n] += captured[n].detach().float().tolist()
    for h in handles:
        h.remove()
    return {"run": str(run), "config": cfg.to_dict(), "grads": grads, "s": s_vals}


def summarize(res: dict[str, Any], difficulty: list[float] | None) -> dict[str, Any]:
    out = {}
    for n, g in res["grads"].items():
        ci = S.mean_ci(g)
        row = {"n": len(g), "mean": ci["mean"], "sd": ci["sd"], "towards_more_heads": sum(v < 0 for v in g) / len(g),
               "zero": sum(v == 0 for v in g) / len(g), "s_sd": S.mean_ci(res["s"][n])["sd"]}
        if difficulty is not None:
            row["spearman_difficulty_pull"] = S.spearman(difficulty[:len(g)], [-v for v in g])
            row["spearman_difficulty_s"] = S.spearman(difficulty[:len(g)], res["s"][n])
            # mean pull (-dL_i/ds_i: > 0 = towards more heads) per difficulty quintile, easiest first
            row["pull_by_difficulty_quintile"] = [b["y_mean"] for b in S.binned_means(difficulty[:len(g)],
                                                                                      [-v for v in g], bins=5)]
        out[n] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("standard", type=Path, nargs="?")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--save", type=Path, default=None, help="also write the summary to this JSON file")
    ap.add_argument("--max-test", type=int, default=None, help="test subsample (match the standard run's)")
    ap.add_argument("--test-seed", type=int, default=None)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    overrides = {k: v for k, v in (("max_test", args.max_test), ("test_seed", args.test_seed),
                                   ("data_dir", args.data_dir)) if v is not None}
    res = pulls(args.run, args.batches, overrides=overrides)
    difficulty = None
    if args.standard and (args.standard / "examples.json").is_file():
        difficulty = json.loads((args.standard / "examples.json").read_text())["loss"]
    summary = summarize(res, difficulty)
    cost = res["config"]["budget_cost"]
    result = {"run": res["run"], "budget_cost_per_example_per_layer": cost / len(summary),
              "method_options": res["config"]["method_options"], "max_steps": res["config"]["max_steps"],
              "max_len": res["config"]["max_len"], "layers": summary}
    print(json.dumps(result, indent=1))
    if args.save:
        args.save.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
