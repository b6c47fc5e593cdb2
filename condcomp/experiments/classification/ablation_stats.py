"""The statistics of a study summary (``statistics.json``): per arm the mean and interval over seeds, per paired
comparison the seed-level t test (the headline), its minimum detectable difference, the per-seed head counts,
and, where the run folders still hold the per-example predictions, the within-seed example bootstrap and
exact McNemar tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from condcomp.experiments import stats as S
from condcomp.experiments.classification.study_page_claims import ClaimRule

# Paired comparisons (arm a, arm b); the first is the study's headline question.
COMPARISONS = (("budgetformer", "fixed_matched"), ("budgetformer", "fixed_per_layer"),
               ("fixed_per_layer", "fixed_matched"), ("budgetformer", "budgetformer_mode_k"),
               ("fixed_per_layer", "random_routing"), ("budgetformer", "standard"), ("moh", "standard"),
               ("budgetformer", "budgetformer_random_heads"))
# A user's component (``condcomp ablate --router-arms / --policy-arms``, arms ``router_<key>`` / ``policy_<key>``)
# against the built-in arm that differs from it in that component only: a router at fixed_matched's budget, a
# policy with BudgetFormer's topk scorer.
USER_ARM_BASELINES = (("router_", "fixed_matched"), ("policy_", "budgetformer"))
ARM_KEYS = ("accuracy", "heads", "s_mean", "flop_fraction", "latency_b1_s", "latency_b64_s",
            "peak_inference_memory_b64_bytes", "inference_gco2")
TARGET = 0.01  # the difference (accuracy, 1 point) the seeds should be able to detect


def _correct(run_dir: Path) -> list[bool] | None:
    f = run_dir / "examples.json"
    return json.loads(f.read_text())["correct"] if f.is_file() else None


def seed_level(diffs: list[float]) -> dict[str, Any]:
    """Paired t over seeds, its verdict, the minimum detectable difference (80 % power) and the seeds needed
    for a 1-point one; without scipy only the mean (and a note)."""
    try:
        t = S.paired_t(diffs)
    except ImportError:
        return {"mean": sum(diffs) / len(diffs), "note": "scipy not installed (pip install 'condcomp[report]')"}
    t["verdict"] = S.seed_verdict(t)
    t["mdd_80"] = S.min_detectable_difference(t["sd"], t["n"])
    t["seeds_for_1pt"] = S.seeds_needed(t["sd"], TARGET)
    return t


def compare(rows: list[dict[str, Any]], a: str, b: str) -> dict[str, Any] | None:
    """Arm ``a`` against arm ``b`` over the seeds both have (None when they share no seed)."""
    ra = {r["seed"]: r for r in rows if r["arm"] == a}
    rb = {r["seed"]: r for r in rows if r["arm"] == b}
    seeds = sorted(set(ra) & set(rb))
    if not seeds:
        return None
    diffs = [ra[s]["accuracy"] - rb[s]["accuracy"] for s in seeds]
    comp: dict[str, Any] = {
        "a": a, "b": b, "seeds": seeds, "diffs": diffs, "seed_t": seed_level(diffs),
        "heads_a": [ra[s]["heads"] for s in seeds], "heads_b": [rb[s]["heads"] for s in seeds],
    }
    pairs = []
    for s in seeds:
        ca, cb = _correct(Path(ra[s]["run_dir"])), _correct(Path(rb[s]["run_dir"]))
        if ca is not None and cb is not None and len(ca) == len(cb):
            pairs.append((s, ca, cb))
    if len({len(p[1]) for p in pairs}) > 1:
        sizes = ", ".join(f"seed {p[0]}: {len(p[1])}" for p in pairs)
        dirs = sorted(r["run_dir"] for r in rows if r["arm"] in (a, b))
        raise ValueError(f"{a} vs {b}: the seeds' runs were scored on different test sets ({sizes} examples), so "
                         f"they cannot be paired; their settings differ. Runs: {', '.join(dirs)}. Rerun them with one "
                         "set of settings into a fresh --out and --summary, or remove the odd seeds' records from "
                         "the summary")
    if pairs and [p[0] for p in pairs] == seeds:
        comp["bootstrap"] = S.paired_bootstrap([p[1] for p in pairs], [p[2] for p in pairs], resample_seeds=False)
        comp["mcnemar"] = {str(p[0]): S.mcnemar(p[1], p[2]) for p in pairs}
    comp["verdict"] = ClaimRule().words(comp)  # the seed-level and the within-seed evidence together
    return comp


def is_user_arm(arm: str) -> bool:
    """Whether ``arm`` is a user's component (``router_<key>`` / ``policy_<key>``), not a built-in arm."""
    return any(arm.startswith(prefix) for prefix, _ in USER_ARM_BASELINES)


def comparisons_of(arms: set[str]) -> list[tuple[str, str]]:
    """:data:`COMPARISONS`, then each user arm in ``arms`` against its built-in counterpart
    (:data:`USER_ARM_BASELINES`)."""
    user = [(arm, base) for prefix, base in USER_ARM_BASELINES for arm in sorted(arms) if arm.startswith(prefix)]
    return [*COMPARISONS, *user]


def statistics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per dataset: every arm's mean and 95 % t-interval over seeds; every comparison of :func:`comparisons_of`
    (those of a user's arm flagged ``user_arm``)."""
    result: dict[str, Any] = {}
    for ds in sorted({r["dataset"] for r in records}):
        rows = [r for r in records if r["dataset"] == ds]
        arms: dict[str, Any] = {}
        for arm in sorted({r["arm"] for r in rows}):
            rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"])
            arms[arm] = {"seeds": [r["seed"] for r in rs]}
            for key in ARM_KEYS:
                arms[arm][key] = S.mean_ci([r[key] for r in rs if r.get(key) is not None])
        comps = {}
        for a, b in comparisons_of(set(arms)):
            comp = compare(rows, a, b)
            if comp is not None:
                comps[f"{a}_vs_{b}"] = {**comp, "user_arm": True} if is_user_arm(a) else comp
        result[ds] = {"arms": arms, "comparisons": comps}
    return result


def merge_kept(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """Keep an earlier example bootstrap and McNemar tests whose run folders are gone, while they still describe
    the runs in the summary: the same seeds and the same mean difference (to the summary's rounding)."""
    for ds, st in new.items():
        for name, comp in st["comparisons"].items():
            prev = ((old.get(ds) or {}).get("comparisons") or {}).get(name)
            if "bootstrap" in comp or not prev or "bootstrap" not in prev or prev.get("seeds") != comp["seeds"]:
                continue
            if abs(prev["bootstrap"]["diff"] - sum(comp["diffs"]) / len(comp["diffs"])) < 1e-5:
                comp["bootstrap"], comp["mcnemar"] = prev["bootstrap"], prev.get("mcnemar")
                comp["bootstrap"].setdefault("resampled", "seeds and examples")
    return new
