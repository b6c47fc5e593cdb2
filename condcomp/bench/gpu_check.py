"""``condcomp bench gpu-check``: one prepared GPU run: check the gathered executor against the reference on CUDA,
then time everything.

    condcomp bench gpu-check --out results/bench/gpu_check/cuda            # checks + full CUDA benchmark
    condcomp bench gpu-check --out results/bench/gpu_check/cuda --quick    # checks + a tiny timing run

Writes ``checks.json`` (every comparison with its max error and tolerance), ``metrics.json`` and ``table.md``
(the ``condcomp bench attention --device cuda`` records) into ``--out``. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from condcomp.bench.attention import run, table
from condcomp.cli_args import output_folder
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import GatheredExecutor, tuning_for
from condcomp.plans import plan_from_active, top_k_mask
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout, HeadPlan

TOL = {torch.float32: 2e-3, torch.bfloat16: 5e-2}  # max abs error relative to the output's max abs value
CASES = ("seq", "seq_causal", "seq_gqa", "seq_same", "token", "token_per_head", "token_causal", "token_gqa")


def case(name: str, dtype: torch.dtype, dev: torch.device) -> tuple[AttentionWeights, AttentionInputs, HeadPlan,
                                                                        list[torch.Tensor]]:
    B, T, D, H, Dh = 6, 64, 256, 8, 32
    Hkv = 2 if "gqa" in name else H
    layout = HeadLayout(D, H, Hkv, Dh, Dh**-0.5, causal="causal" in name)

    def p(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dtype).requires_grad_()

    w = AttentionWeights(layout, p(H * Dh, D), p(Hkv * Dh, D), p(Hkv * Dh, D), p(D, H * Dh), p(H * Dh),
                         p(Hkv * Dh), p(Hkv * Dh), p(D))
    x = torch.randn(B, T, D, device=dev).to(dtype).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    mask[1, 40:] = False
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
    plan = plan_from_active(active, gates)
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask)
    return w, inputs, plan, [x, w.q_weight, w.k_weight, w.o_weight, w.o_bias, gates]  # type: ignore[list-item]


def checks(dev: torch.device) -> list[dict]:
    results = []
    ref = get_executor("reference")
    # token plans: the per-set strategy at these sizes (its size rule lifted), and forced per head
    by_set = GatheredExecutor(tuning=replace(tuning_for(dev), min_set_work=0))
    strategies = {"token_per_head": GatheredExecutor(strategy="token.per_head")}
    for dtype in (torch.float32, torch.bfloat16):
        for name in CASES:
            torch.manual_seed(0)
            w, inputs, plan, leaves = case(name, dtype, dev)
            outs = []
            for ex in (ref, strategies.get(name, by_set)):
                y = ex(w, inputs, plan)
                # the plan's gates are one graph shared by both executors: keep it for the second backward
                grads = torch.autograd.grad(y.float().square().sum(), leaves, retain_graph=True)
                outs.append([y, *grads])
            for label, a, b in zip(["y", "x", "q_weight", "k_weight", "o_weight", "o_bias", "gates"], *outs):
                a, b = a.detach().float(), b.detach().float()
                err = float((a - b).abs().max() / a.abs().max().clamp_min(1e-6))
                ok = err <= TOL[dtype] * (1 if label == "y" else 4)
                results.append({"case": name, "dtype": str(dtype), "tensor": label, "rel_err": err, "ok": ok})
                print(f"{'ok ' if ok else 'FAIL'} {name:13s} {str(dtype):15s} {label:9s} rel_err={err:.2e}")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=output_folder, required=True,
                        help="folder for checks.json, metrics.json and table.md")
    parser.add_argument("--quick", action="store_true", help="the checks and a tiny timing run")


def main(args: argparse.Namespace | None = None) -> int:
    """Entry point of ``condcomp bench gpu-check`` and ``python -m condcomp.bench.gpu_check``."""
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: torch.cuda.is_available() is False; run it on a machine with a CUDA GPU")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    results = checks(dev)
    (out / "checks.json").write_text(json.dumps(results, indent=1))
    records = run("cuda", quick=args.quick)
    (out / "metrics.json").write_text(json.dumps(records, indent=1))
    (out / "table.md").write_text(table(records) + "\n")
    print(table(records))
    return 0 if all(r["ok"] for r in results) else 1


def add_bench_commands(bench_subparsers: Any) -> None:
    """Register ``condcomp bench gpu-check``."""
    p = bench_subparsers.add_parser("gpu-check", help="on a CUDA GPU: gathered vs reference checks, then the "
                                    "attention benchmark (checks.json, metrics.json, table.md)")
    add_arguments(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(main())
