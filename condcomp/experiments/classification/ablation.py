"""The multi-seed ablation study: every arm for every seed, resumable, one summary of records, statistics.

``condcomp ablate --dataset D --seeds 0 1 2 --out runs/study --summary results/reproduction/summary.json``:

- runs live in ``<out>/<dataset>/seed<k>/<arm>/`` (metrics.json, examples.json with the per-example
  predictions, checkpoint/); they stay out of git. A run whose metrics.json and checkpoint exist (same
  settings) is reused, so a stopped study continues where it stopped with the same command.
- every finished run is added to the summary at once (a JSON list of records, one per dataset x arm x seed;
  rewritten atomically), and the statistics (``statistics.json`` beside the summary: intervals over seeds,
  paired tests on the test predictions) are recomputed from the run folders.

Arms (``--arms`` and the sweep flags):

- ``standard``: every head. ``budgetformer``: the paper's loss (task + hinge + entropy; ``--budget-cost`` of
  the study, 0 by default). ``fixed_matched``: fixed top-k trained at the head count nearest to that seed's
  BudgetFormer realised mean (its run folder is ``fixed_<fraction>``, shared with the sweep arm of the same
  fraction). ``moh``: MoH with the released load-balance weighting.
- ``fixed_per_layer``: fixed top-k trained at BudgetFormer's realised mean head count *per layer* (same seed;
  a fractional mean is rounded per example so that the mean matches): the learned per-layer allocation without
  per-input variation. ``random_routing``: the same per-layer counts, heads drawn at random in training and
  evaluation (does learned routing beat random routing when both are trained?).
- controls on the trained BudgetFormer model, no retraining: ``budgetformer_random_heads`` (random heads at its
  learned budget), ``budgetformer_forced_matched`` (forced to the matched fixed fraction),
  ``budgetformer_all_heads``, ``budgetformer_mode_k`` (every example's k replaced by its layer's most common k
  and s by the layer's mean s: the accuracy lost is what per-input adaptivity is worth; also recorded in the
  budgetformer record as ``control_mode_k``).
- the ``standard`` arm (trained first when asked for) is the difficulty proxy of the budget arms: their
  ``difficulty`` and the difficulty correlation in ``adaptivity`` need it in the same run folder (without it,
  ``difficulty`` is taken from the summary's earlier record of the identical run, else left empty).
- every BudgetFormer record carries ``adaptivity`` (:mod:`.adaptivity`): the per-example
  spread of s and k per layer, the share of examples off the layer's most common k, head-set entropy, and the
  rank correlation of s with the standard model's per-example loss.
- your components: ``router_<key>`` for each ``--router-arms`` (a registered name or ``module:Class``): fixed
  top-k's budget (the matched fraction when BudgetFormer is trained, else half the heads) with your router
  choosing the heads, to compare with ``fixed_matched``; ``policy_<key>`` for each ``--policy-arms``: your
  budget policy with the topk scorer, to compare with ``budgetformer``. The record holds the spec.
- sweep: ``fixed_<f>`` for ``--sweep-fractions`` (``fixed_1`` is the standard arm: k = H, gates 1 is the
  same model), ``budgetformer_cost<c>`` for ``--budget-costs`` (an extra price ``c * mean(s)`` on heads),
  ``moh_k<K>`` for ``--moh-topk`` (the main MoH arm's shared heads, another K).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from condcomp.experiments.classification.ablation_summary import (
    difficulty,
    load_summary,
    record,
    run_adaptivity,
    same_run_difficulty,
    upsert,
    write_statistics,
)
from condcomp.experiments.classification.adaptivity import mode_budgets
from condcomp.experiments.classification.methods import DEFAULTS
from condcomp.experiments.classification.runconfig import RunConfig, check_same_settings
from condcomp.experiments.classification.seed_study import SeedStudy, matched_fraction
from condcomp.experiments.classification.user_components import arm_name, resolve
from condcomp.registry import ROUTERS

MAIN_ARMS = ("standard", "budgetformer", "fixed_matched", "moh")
# Trained at BudgetFormer's per-layer mean head counts of the same seed: top-k scorer / random heads.
LAYER_ARMS = ("fixed_per_layer", "random_routing")
CONTROLS = ("budgetformer_random_heads", "budgetformer_forced_matched", "budgetformer_all_heads",
            "budgetformer_mode_k")
DEFAULT_ARMS = MAIN_ARMS + ("budgetformer_random_heads",)


@dataclass
class AblationPlan:
    arms: tuple[str, ...] = DEFAULT_ARMS
    sweep_fractions: tuple[float, ...] = ()
    budget_costs: tuple[float, ...] = ()
    moh_topk: tuple[int, ...] = ()
    moh: dict[str, Any] = field(default_factory=dict)
    budgetformer: dict[str, Any] = field(default_factory=dict)
    router_arms: tuple[str, ...] = ()  # a user's routers (registered names or module:Class specs)
    policy_arms: tuple[str, ...] = ()  # a user's budget policies
    # fixed_matched and fixed_per_layer train with BudgetFormer's router_options (its topk schedule), so that
    # they differ from it only in the budget (--share-router-schedule)
    share_router: bool = False

    def fixed_router(self) -> dict[str, Any]:
        """The router options the fixed top-k arms train with: BudgetFormer's when shared, else none."""
        ro = self.budgetformer.get("router_options") if self.share_router else None
        return {"router_options": ro} if ro else {}

    def __post_init__(self) -> None:
        valid = set(MAIN_ARMS) | set(LAYER_ARMS) | set(CONTROLS)
        bad = [a for a in self.arms if a not in valid]
        if bad:
            raise ValueError(f"unknown arm(s) {bad}; valid: {sorted(valid)} (sweeps: --sweep-fractions, "
                             "--budget-costs, --moh-topk)")
        for f in self.sweep_fractions:
            if not 0 < f <= 1:
                raise ValueError(f"--sweep-fractions must be in (0, 1], got {f}")
        for c in self.budget_costs:
            if c < 0:
                raise ValueError(f"--budget-costs must be >= 0, got {c}")
        for k in self.moh_topk:
            if k < 1:
                raise ValueError(f"--moh-topk must be >= 1, got {k}")

    def arm_names(self) -> list[str]:
        names = list(self.arms)
        names += [f"fixed_{f:g}" for f in self.sweep_fractions]
        names += [f"budgetformer_cost{c:g}" for c in self.budget_costs]
        names += [f"moh_k{k}" for k in self.moh_topk]
        names += [arm_name("router", spec) for spec in self.router_arms]
        names += [arm_name("policy", spec) for spec in self.policy_arms]
        return names


def _seed_done(names: list[str], summary: list[dict[str, Any]], dataset: str, seed: int) -> bool:
    have = {r["arm"]: r for r in summary if r["dataset"] == dataset and r["seed"] == seed}
    return all(n in have and (Path(have[n]["run_dir"]) / "metrics.json").is_file() for n in names)


def _finished_runs(out: Path, dataset: str, summary: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any],
                                                                                        tuple[str, ...]]]:
    """Every finished run a study of ``dataset`` would reuse or combine: its run folders under ``out`` and the
    summary's records, with their saved settings and the fields each arm sets itself."""
    def varies(arm: str) -> tuple[str, ...]:
        per_arm: tuple[str, ...] = ("seed", "method", "method_options")
        if not arm.startswith("budgetformer"):
            per_arm += ("budget_target",)  # only arms with a learned budget train with the difficulty target
        return per_arm + ("budget_cost",) if arm.startswith("budgetformer_cost") else per_arm

    runs = {str(f.parent): (json.loads(f.read_text()).get("config") or {}, varies(f.parent.name))
            for f in sorted((out / dataset).glob("seed*/*/metrics.json"))}
    for r in summary:
        if r.get("dataset") == dataset and str(r.get("run_dir")) not in runs:
            runs[str(r.get("run_dir"))] = (r.get("setup") or {}, varies(str(r.get("arm"))))
    return [(label, found, allowed) for label, (found, allowed) in runs.items()]


def run_ablation_study(cfg: RunConfig, out: Path, seeds: list[int], plan: AblationPlan, summary_path: Path,
                       command: str | None = None, log: Any = None) -> list[dict[str, Any]]:
    """Every arm of ``plan`` for every seed on ``cfg.dataset``; returns this dataset's summary records."""
    command = command or "condcomp " + " ".join(sys.argv[1:])
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if cfg.budget_cost != 0 and "budgetformer" in plan.arms:
        log(f"note: the main budgetformer arm trains with --budget-cost {cfg.budget_cost}, not the paper's loss")
    if cfg.budget_target != 0:
        log(f"note: the budgetformer arms train with the difficulty target --budget-target {cfg.budget_target}, "
            "not the paper's loss; the other arms without it")
    names = plan.arm_names()
    base = RunConfig.from_dict({**cfg.to_dict(), "test_seed": 1 if cfg.test_seed is None else cfg.test_seed})
    fresh = (f"give another --out (now {out}; its summary.json goes with it)" if summary_path == out / "summary.json"
             else f"give another --out and --summary (now {out} and {summary_path})")
    check_same_settings(base, _finished_runs(out, cfg.dataset, load_summary(summary_path)),
                        f"{fresh}, or delete those runs and their records")
    for seed in seeds:
        sdir = out / cfg.dataset / f"seed{seed}"
        if _seed_done(names, load_summary(summary_path), cfg.dataset, seed):
            log(f"{cfg.dataset} seed {seed}: every arm done, skipped")
            continue
        log(f"{cfg.dataset} seed {seed}: arms {names} -> {sdir}")
        scfg = RunConfig.from_dict({**base.to_dict(), "seed": seed})
        run = SeedRun(SeedStudy(scfg, sdir), cfg.dataset, seed, sdir, out, summary_path, command, log)
        if "standard" in names:  # first: it is the difficulty proxy of the budget arms (their loss per example)
            run.study.train("standard", "standard")
            run.done("standard")
        matched = _budgetformer_arms(run, plan, names)
        _matched_and_moh_arms(run, plan, names, matched)
        _controls(run, names, matched)
        _sweep_arms(run, plan)
        _user_arms(run, plan, matched)
        if not all(run.study.reused.get(n, True) for n in run.study.rows):
            _retime(run, scfg.latency_reps)
    return [r for r in load_summary(summary_path) if r["dataset"] == cfg.dataset]


@dataclass
class SeedRun:
    """One seed of the study in progress: its arms (a :class:`SeedStudy`) and where their records go."""

    study: SeedStudy
    dataset: str
    seed: int
    sdir: Path
    out: Path
    summary_path: Path
    command: str
    log: Callable[[str], Any]

    def done(self, arm: str, extra: dict[str, Any] | None = None, run: str | None = None) -> None:
        """Add the finished ``arm`` (run folder ``run``, default the arm's name) to the summary and statistics."""
        sdir = self.sdir
        rec = record(self.study.rows[arm], self.dataset, arm, self.seed, self.command, sdir / (run or arm), extra)
        if arm.startswith("budgetformer") and "control_of" not in rec:
            rec["difficulty"] = difficulty(sdir / arm, sdir / "standard") or same_run_difficulty(
                self.summary_path, rec)
            rec["adaptivity"] = run_adaptivity(sdir / arm, sdir / "standard", rec["model"]["num_heads"])
        upsert(self.summary_path, [rec])
        write_statistics(self.summary_path, self.out)
        self.log(f"{self.dataset} seed {self.seed} {arm}: accuracy {rec['accuracy']:.4f}, heads {rec['heads']:.3f}"
                 + (" (reused)" if self.study.reused.get(arm) else ""))


def _budgetformer_arms(run: SeedRun, plan: AblationPlan, names: list[str]) -> float | None:
    """BudgetFormer, its mode-k control and the arms trained at its per-layer head counts; returns the fixed
    fraction matched to its realised mean (None when no arm needs BudgetFormer)."""
    if not any(n in names for n in ("budgetformer", "fixed_matched") + LAYER_ARMS + CONTROLS):
        return None
    study, sdir = run.study, run.sdir
    bf = study.train("budgetformer", "budgetformer", plan.budgetformer)
    H = int(bf["model"]["num_heads"])
    adapt = run_adaptivity(sdir / "budgetformer", sdir / "standard", H)
    if "budgetformer_mode_k" in names:
        if adapt is None:
            raise ValueError(f"{sdir / 'budgetformer'}: its examples.json has no per-layer head counts (a run "
                             "made before they were recorded); delete that folder to retrain it")
        budgets = mode_budgets(adapt)
        study.control("budgetformer_mode_k", "budgetformer", policy="constant", budgets=budgets)
    if "budgetformer" in names:
        mode_k = study.rows.get("budgetformer_mode_k")
        run.done("budgetformer", {"control_mode_k": None if mode_k is None else {
            "accuracy": mode_k["accuracy"], "heads": mode_k["k_frac"],
            "accuracy_lost": bf["accuracy"] - mode_k["accuracy"]}})
    if "budgetformer_mode_k" in names:
        run.done("budgetformer_mode_k", {"budgets": budgets})
    layer_heads = {n: min(float(H), max(1.0, v["k_frac"] * H)) for n, v in bf["layers"].items()}
    for arm, routing in (("fixed_per_layer", "learned"), ("random_routing", "random")):
        if arm in names:
            shared = plan.fixed_router() if routing == "learned" else {}
            study.train(arm, "fixed_layers", {"heads": layer_heads, "routing": routing, **shared})
            run.done(arm, {"layer_heads": layer_heads})
    return matched_fraction(bf["k_frac"], H, rounding="nearest")


def _matched_and_moh_arms(run: SeedRun, plan: AblationPlan, names: list[str], matched: float | None) -> None:
    """Fixed top-k at the matched fraction (its run folder shared with the sweep arm of that fraction) and MoH."""
    if "fixed_matched" in names:
        assert matched is not None
        shared = plan.fixed_router()
        folder = f"fixed_{matched:g}" + ("_shared_router" if shared else "")  # not the sweep arm's run then
        run.study.train(folder, "fixed", {"fraction": matched, **shared})
        run.study.rows["fixed_matched"] = run.study.rows[folder]
        run.done("fixed_matched", {"matched_fraction": matched}, run=folder)
    if "moh" in names:
        run.study.train("moh", "moh", plan.moh)
        run.done("moh")


def _controls(run: SeedRun, names: list[str], matched: float | None) -> None:
    """The trained BudgetFormer evaluated with its router or policy swapped (no retraining)."""
    for arm, kw in (("budgetformer_random_heads", {"router": "random"}),
                    ("budgetformer_forced_matched", {"policy": "fixed", "fraction": matched}),
                    ("budgetformer_all_heads", {"policy": "full"})):
        if arm in names:
            run.study.control(arm, "budgetformer", **kw)
            run.done(arm, {"matched_fraction": matched} if arm.endswith("matched") else None)


def _sweep_arms(run: SeedRun, plan: AblationPlan) -> None:
    """``fixed_<f>``, ``budgetformer_cost<c>`` and ``moh_k<K>`` (``fixed_1`` is the standard arm's record)."""
    study = run.study
    for f in plan.sweep_fractions:
        arm = f"fixed_{f:g}"
        if math.isclose(f, 1.0):
            study.rows[arm] = study.rows["standard"]
            run.done(arm, {"alias_of": "standard", "fraction": 1.0}, run="standard")
            continue
        study.train(arm, "fixed", {"fraction": f})
        run.done(arm, {"fraction": f})
    for c in plan.budget_costs:
        arm = f"budgetformer_cost{c:g}"
        study.train(arm, "budgetformer", plan.budgetformer, overrides={"budget_cost": c})
        run.done(arm, {"budget_cost": c})
    for k in plan.moh_topk:
        arm = f"moh_k{k}"
        study.train(arm, "moh", {**plan.moh, "top_k": k})
        run.done(arm, {"top_k": k})


def _user_arms(run: SeedRun, plan: AblationPlan, matched: float | None) -> None:
    """The user's components (:mod:`.user_components`): ``router_<key>`` chooses the heads at fixed top-k's
    budget (the matched fraction, else half the heads), ``policy_<key>`` sets the budget for the topk scorer.
    The spec goes into the run's settings, so a reused run, ``condcomp eval`` and the record name it."""
    fraction = matched if matched is not None else DEFAULTS["fixed"]["fraction"]
    for spec in plan.router_arms:
        arm = arm_name("router", spec)
        per_token = ROUTERS.get(resolve("router", spec)).granularity == "token"  # a budget per token then
        run.study.train(arm, "fixed", {"fraction": fraction, "router": spec, **({"per_token": True} if per_token
                                                                               else {})})
        run.done(arm, {"router": spec, "fraction": fraction})
    for spec in plan.policy_arms:
        arm = arm_name("policy", spec)
        run.study.train(arm, "fixed", {"policy": spec})
        run.done(arm, {"policy": spec})


def _retime(run: SeedRun, reps: int) -> None:
    """Re-time every arm of this seed round-robin, so that all see the same machine load, and put the paired
    latencies into their records."""
    run.study.paired_timing(reps)
    current = {r["arm"]: r for r in load_summary(run.summary_path)
               if r["dataset"] == run.dataset and r["seed"] == run.seed}
    recs = []
    for arm, rec in current.items():
        timed = run.study.rows.get(arm)
        if timed is None or timed.get("latency_b1") is None:
            continue
        rec.update({"latency_b1_s": timed["latency_b1"], "latency_b64_s": timed["latency_b64"],
                    "latency_paired": bool(timed.get("latency_paired"))})
        recs.append(rec)
    upsert(run.summary_path, recs)
    write_statistics(run.summary_path, run.out)  # the re-timed latencies, from the same records
