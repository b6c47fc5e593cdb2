"""Within-seed (test-example) evidence for the 2x2, computed with numpy/scipy only (not condcomp's statistics).

The seed-level intervals in README_2x2.md rest on a few seeds (five). This adds what the test examples say, per cell and
seed, for BudgetFormer - fixed_per_layer (both arms score the same 7,600 AG News test examples in the same order):

- exact McNemar: scipy.stats.binomtest on the discordant pairs (BudgetFormer right and fixed wrong vs the reverse);
- a paired bootstrap over the test examples of the accuracy difference (10,000 resamples, 95 % percentile);
- pooled over the seeds of a cell: McNemar on the summed discordant pairs, and the two-stage bootstrap over seeds
  and examples (resample the seeds, then the examples independently within each drawn seed);
- the target's and the schedule's effect on the gap (the 2x2 contrasts README_2x2.md gives at the seed level), per
  example: ((gap in the two cells with the factor on) - (gap in the two with it off)) / 2, and their interaction
  (the target's effect with the schedule minus its effect without), bootstrapped the same way, with a one-sample t
  test over the examples (per seed, and over every seed's examples pooled);
- budgetformer_mode_k - fixed_matched and budgetformer - budgetformer_mode_k per cell, pooled over its seeds (McNemar
  and the seeds-and-examples bootstrap).

The per-example correctness is committed in ``correct_2x2.json`` (bit-packed, hex), extracted from the runs'
``examples.json`` by ``--extract RUNS`` (RUNS: the folder holding ``<cell>/ag_news/seed<N>/<arm>/``, the 2x2's
``OUT``; the runs themselves are not committed). Then::

    python results/reproduction_target/within_seed_2x2.py            # prints the table
    python results/reproduction_target/within_seed_2x2.py --write    # and puts it into README_2x2.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.stats import binomtest, ttest_1samp

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent
RECORD = HERE / "correct_2x2.json"
README = HERE / "README_2x2.md"
CELLS = {"target_schedule": ("on", "exploration"), "target_default": ("on", "topk defaults"),
         "notarget_schedule": ("off", "exploration"), "notarget_default": ("off", "topk defaults")}
ARMS = ("budgetformer", "fixed_per_layer", "budgetformer_mode_k", "fixed_matched", "standard")
RESAMPLES = 10_000
BEGIN, END = "<!-- within-seed table: begin -->", "<!-- within-seed table: end -->"


def summary(cell: str) -> list[dict]:
    return json.loads((RESULTS / f"reproduction_2x2_{cell}" / "summary.json").read_text())


def extract(runs: Path) -> None:
    """Pack each run's per-example correctness; refuse a run whose accuracy or example order disagrees."""
    out: dict = {"n_test": None, "cells": {}}
    lengths = None
    for cell in CELLS:
        for rec in summary(cell):
            if rec["arm"] not in ARMS:
                continue
            run = runs / cell / Path(rec["run_dir"]).relative_to(Path(rec["run_dir"]).parents[2])
            ex = json.loads((run / "examples.json").read_text())
            correct = np.asarray(ex["correct"], dtype=bool)
            if abs(correct.mean() - rec["accuracy"]) > 1e-5:
                raise SystemExit(f"{run}: examples.json's accuracy {correct.mean():.6f} is not the summary's "
                                 f"{rec['accuracy']}: the run folder is not the one the summary recorded")
            if lengths is None:
                lengths = ex["length"]
            elif ex["length"] != lengths:
                raise SystemExit(f"{run}: its test examples are not in the order of the others (lengths differ)")
            out["n_test"] = len(correct)
            out["cells"].setdefault(cell, {}).setdefault(str(rec["seed"]), {})[rec["arm"]] = \
                np.packbits(correct).tobytes().hex()
    RECORD.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")


def load() -> tuple[dict[str, dict[int, dict[str, np.ndarray]]], int]:
    rec = json.loads(RECORD.read_text())
    n = rec["n_test"]
    unpack = lambda h: np.unpackbits(np.frombuffer(bytes.fromhex(h), dtype=np.uint8))[:n].astype(bool)  # noqa: E731
    return {c: {int(s): {a: unpack(h) for a, h in arms.items()} for s, arms in seeds.items()}
            for c, seeds in rec["cells"].items()}, n


def bootstrap_examples(d: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95 % percentile interval of the mean of d over examples (d takes few values: resample their counts)."""
    values, counts = np.unique(d, return_counts=True)
    draws = rng.multinomial(len(d), counts / len(d), size=RESAMPLES)  # (RESAMPLES, values)
    means = draws @ values / len(d)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def bootstrap_seeds_examples(ds: list[np.ndarray], rng: np.random.Generator) -> tuple[float, float]:
    """The two-stage bootstrap: resample the seeds, then, independently for every drawn seed (a seed drawn twice
    gets two independent resamples), the examples within it; the mean over the drawn seeds."""
    pick = rng.integers(0, len(ds), size=(RESAMPLES, len(ds)))  # (RESAMPLES, seeds): seeds drawn with replacement
    drawn = np.empty(pick.shape)  # (RESAMPLES, seeds): each drawn seed's mean over its own example resample
    for i, d in enumerate(ds):
        where = pick == i
        values, counts = np.unique(d, return_counts=True)
        drawn[where] = rng.multinomial(len(d), counts / len(d), size=int(where.sum())) @ values / len(d)
    means = drawn.mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def pts(x: float) -> str:
    return f"{100 * x:+.2f}"


def pval(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def table() -> str:
    data, n = load()
    rng = np.random.default_rng(0)
    rows = ["| target | router schedule | seed | BudgetFormer - fixed_per_layer | discordant (BF only / fixed only) | "
            "McNemar exact p | bootstrap over examples |", "|---|---|---|---|---|---|---|"]
    gaps: dict[str, dict[int, np.ndarray]] = {}
    for cell, (target, schedule) in CELLS.items():
        seeds = sorted(data[cell])
        gaps[cell] = {}
        b_sum = c_sum = 0
        for s in seeds:
            bf, fx = data[cell][s]["budgetformer"], data[cell][s]["fixed_per_layer"]
            d = bf.astype(int) - fx.astype(int)
            gaps[cell][s] = d
            b, c = int(np.sum(d == 1)), int(np.sum(d == -1))
            b_sum, c_sum = b_sum + b, c_sum + c
            lo, hi = bootstrap_examples(d, rng)
            p = binomtest(b, b + c, 0.5).pvalue
            rows.append(f"| {target} | {schedule} | {s} | {pts(d.mean())} | {b} / {c} | {pval(p)} | "
                        f"[{pts(lo)}, {pts(hi)}] |")
        lo, hi = bootstrap_seeds_examples([gaps[cell][s] for s in seeds], rng)
        mean = np.mean([gaps[cell][s].mean() for s in seeds])
        p = binomtest(b_sum, b_sum + c_sum, 0.5).pvalue
        rows.append(f"| {target} | {schedule} | pooled ({len(seeds)}) | {pts(mean)} | {b_sum} / {c_sum} | {pval(p)} | "
                    f"[{pts(lo)}, {pts(hi)}] (seeds and examples) |")
    seeds = sorted(set.intersection(*(set(g) for g in gaps.values())))
    # each contrast: (cells counted +, cells counted -, divisor), on the per-example gap
    effects = {"target": (("target_schedule", "target_default"), ("notarget_schedule", "notarget_default"), 2),
               "router schedule": (("target_schedule", "notarget_schedule"), ("target_default", "notarget_default"), 2),
               "interaction": (("target_schedule", "notarget_default"), ("target_default", "notarget_schedule"), 1)}
    lines = ["", "The factors' effects on that gap (per example: the gap with the factor on minus the gap with it "
             "off, averaged over the other factor's two levels; the interaction: the target's effect with the "
             "exploration schedule minus its effect with topk's defaults):", "",
             "| factor | seed | effect on the gap | bootstrap over examples | one-sample t p over the examples |",
             "|---|---|---|---|---|"]
    for name, (on, off, divisor) in effects.items():
        per_seed = []
        for s in seeds:
            e = (gaps[on[0]][s] + gaps[on[1]][s] - gaps[off[0]][s] - gaps[off[1]][s]) / divisor
            per_seed.append(e)
            lo, hi = bootstrap_examples(e, rng)
            lines.append(f"| {name} | {s} | {pts(e.mean())} | [{pts(lo)}, {pts(hi)}] | "
                         f"{pval(ttest_1samp(e, 0.0).pvalue)} |")
        lo, hi = bootstrap_seeds_examples(per_seed, rng)
        pooled_p = ttest_1samp(np.concatenate(per_seed), 0.0).pvalue  # every seed's examples as one sample
        lines.append(f"| {name} | pooled ({len(seeds)}) | {pts(np.mean([e.mean() for e in per_seed]))} | "
                     f"[{pts(lo)}, {pts(hi)}] (seeds and examples) | {pval(pooled_p)} (pooled examples) |")
    pooled = {("budgetformer_mode_k", "fixed_matched"): "each run at fixed per-layer counts; the counts can differ "
              "between the two, see the heads above",
              ("budgetformer", "budgetformer_mode_k"): "a count per input vs each layer's most common count"}
    for (first, second), what in pooled.items():
        lines += ["", f"{first} - {second} ({what}), pooled over the seeds of each cell:", "",
                  f"| target | router schedule | seeds | {first} - {second} | discordant ({first} only / {second} "
                  "only) | McNemar exact p | bootstrap over seeds and examples |", "|---|---|---|---|---|---|---|"]
        for cell, (target, schedule) in CELLS.items():
            ds = [data[cell][s][first].astype(int) - data[cell][s][second].astype(int) for s in sorted(data[cell])]
            b, c = sum(int(np.sum(d == 1)) for d in ds), sum(int(np.sum(d == -1)) for d in ds)
            lo, hi = bootstrap_seeds_examples(ds, rng)
            lines.append(f"| {target} | {schedule} | {len(ds)} | {pts(np.mean([d.mean() for d in ds]))} | {b} / {c} | "
                         f"{pval(binomtest(b, b + c, 0.5).pvalue)} | [{pts(lo)}, {pts(hi)}] |")
    head = (f"Within seeds, on the {n:,} test examples (`within_seed_2x2.py`, numpy/scipy; bootstrap "
            f"{RESAMPLES:,} resamples, seed 0):")
    return "\n".join([head, "", *rows, *lines])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extract", type=Path, metavar="RUNS", help="pack the runs' examples.json into correct_2x2.json")
    ap.add_argument("--write", action="store_true", help="put the table into README_2x2.md between its markers")
    args = ap.parse_args()
    if args.extract:
        extract(args.extract)
    text = table()
    print(text)
    if args.write:
        readme = README.read_text()
        if BEGIN not in readme or END not in readme:
            raise SystemExit(f"{README} has no {BEGIN} ... {END} markers to write between")
        head, rest = readme.split(BEGIN, 1)
        README.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
