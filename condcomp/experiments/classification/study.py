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
- sweep: ``fixed_<f>`` for ``--sweep-fractions`` (``fixed_1`` is the standard arm: k = H, gates 1 is the
  same model), ``budgetformer_cost<c>`` for ``--budget-costs`` (an extra price ``c * mean(s)`` on heads),
  ``moh_k<K>`` for ``--moh-topk`` (the main MoH arm's shared heads, another K).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from condcomp.experiments import stats as S
from condcomp.experiments.classification.ablate import Study, matched_fraction
from condcomp.experiments.classification.adaptivity import adaptivity, mode_budgets
from condcomp.experiments.classification.runconfig import RunConfig, check_same_settings
from condcomp.experiments.classification.runner import write_json

MAIN_ARMS = ("standard", "budgetformer", "fixed_matched", "moh")
# Trained at BudgetFormer's per-layer mean head counts of the same seed: top-k scorer / random heads.
LAYER_ARMS = ("fixed_per_layer", "random_routing")
CONTROLS = ("budgetformer_random_heads", "budgetformer_forced_matched", "budgetformer_all_heads",
            "budgetformer_mode_k")
DEFAULT_ARMS = MAIN_ARMS + ("budgetformer_random_heads",)
SETUP_FIELDS = ("preset", "d_model", "num_layers", "num_heads", "d_ff", "max_len", "max_train", "max_test",
                "test_seed", "tokenizer", "epochs", "max_steps", "batch_size", "lr", "weight_decay", "warmup",
                "dropout", "pooling", "budget_cost", "threads", "latency_reps", "carbon_country")


@dataclass
class StudyPlan:
    arms: tuple[str, ...] = DEFAULT_ARMS
    sweep_fractions: tuple[float, ...] = ()
    budget_costs: tuple[float, ...] = ()
    moh_topk: tuple[int, ...] = ()
    moh: dict[str, Any] = field(default_factory=dict)
    budgetformer: dict[str, Any] = field(default_factory=dict)

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
        return names


# --- the summary -----------------------------------------------------------------------------------------


def load_summary(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); fix or remove it") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a study summary is a JSON list of records")
    return data


def _rounded(obj: Any) -> Any:
    """Floats to 6 significant digits (the summary is read by people and diffed in git)."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside ``path`` (two study jobs may share one summary); no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def upsert(path: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace the records with the same (dataset, arm, seed), keep the rest; sorted; written atomically
    under a lock (read-modify-write: concurrent study jobs must not lose each other's records)."""
    records = [_rounded(r) for r in records]
    keys = {(r["dataset"], r["arm"], r["seed"]) for r in records}
    with _locked(path):
        rows = [r for r in load_summary(path) if (r["dataset"], r["arm"], r["seed"]) not in keys] + records
        rows.sort(key=lambda r: (r["dataset"], r["seed"], r["arm"]))
        write_json(path, rows)
    return rows


def difficulty(run_dir: Path, standard_dir: Path) -> dict[str, Any] | None:
    """Predicted budget against the standard model's per-example loss and the input length (same seed)."""
    ex_file, std_file = run_dir / "examples.json", standard_dir / "examples.json"
    if not (ex_file.is_file() and std_file.is_file()):
        return None
    ex, std = json.loads(ex_file.read_text()), json.loads(std_file.read_text())
    if "loss" not in std or "length" not in ex or len(std["loss"]) != len(ex["s"]):
        return None
    s, k, loss, length = ex["s"], ex["k_frac"], std["loss"], [float(v) for v in ex["length"]]
    out: dict[str, Any] = {"n": len(s), "s_sd": S.mean_ci(s)["sd"]}
    for name, proxy in (("loss", loss), ("length", length)):
        out[name] = {"pearson_s": S.pearson(proxy, s), "spearman_s": S.spearman(proxy, s),
                     "spearman_heads": S.spearman(proxy, k),
                     "bins": [{**b, "heads": h["y_mean"]} for b, h in
                              zip(S.binned_means(proxy, s), S.binned_means(proxy, k))]}
    return out


def _same_run_difficulty(summary_path: Path, rec: dict[str, Any]) -> dict[str, Any] | None:
    """Without the standard run's folder: the difficulty of the summary's earlier record of the same run (same
    dataset, arm, seed, command settings, and the same accuracy and s_mean to the summary's rounding: training is
    deterministic on CPU, so a rerun reproduces the model), else None."""
    for old in load_summary(summary_path):
        if (old["dataset"], old["arm"], old["seed"]) == (rec["dataset"], rec["arm"], rec["seed"]) \
                and old.get("difficulty") and old.get("setup") == _rounded(rec["setup"]) \
                and old.get("accuracy") == _rounded(rec["accuracy"]) and old.get("s_mean") == _rounded(rec["s_mean"]):
            return {**old["difficulty"], "from": "the earlier record of this run (identical accuracy and s_mean)"}
    return None


def run_adaptivity(run_dir: Path, standard_dir: Path, num_heads: int) -> dict[str, Any] | None:
    """:func:`adaptivity.adaptivity` of a run folder, difficulty = the same seed's standard model's loss."""
    ex_file, std_file = run_dir / "examples.json", standard_dir / "examples.json"
    if not ex_file.is_file():
        return None
    ex = json.loads(ex_file.read_text())
    loss = json.loads(std_file.read_text()).get("loss") if std_file.is_file() else None
    return adaptivity(ex, num_heads, loss if loss is not None and len(loss) == len(ex["s"]) else None)


def record(row: dict[str, Any], dataset: str, arm: str, seed: int, command: str, run_dir: Path,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One summary record from a run's metrics row."""
    cfg = row.get("config") or {}
    carbon = row.get("carbon_eval") or {}
    gco2 = carbon.get("gco2")
    if gco2 is not None:
        note = (f"codecarbon OfflineEmissionsTracker (country {carbon.get('country')}), evaluation of the whole "
                f"test split ({row.get('n')} examples, batch {cfg.get('eval_batch_size')})")
    else:
        note = carbon.get("note") or "not measured"
    train = row.get("train") or {}
    rec = {
        "dataset": dataset, "arm": arm, "seed": seed, "method": row.get("method"),
        "method_options": cfg.get("method_options"), "accuracy": row.get("accuracy"), "heads": row.get("k_frac"),
        "s_mean": row.get("s_mean"), "flop_fraction": row.get("flop_frac"),
        "latency_b1_s": row.get("latency_b1"), "latency_b64_s": row.get("latency_b64"),
        "latency_executor": row.get("executor"), "latency_paired": bool(row.get("latency_paired")),
        "peak_inference_memory_b64_bytes": row.get("peak_mem_b64"),
        "inference_gco2": gco2, "inference_gco2_note": note,
        "n_test": row.get("n"), "n_train": (row.get("data") or {}).get("train_rows"),
        "train_seconds": train.get("seconds"), "train_steps": train.get("step"),
        "layers": {n: v.get("k_frac") for n, v in (row.get("layers") or {}).items()},
        "head_freq": row.get("head_freq") if row.get("method") != "standard" else None,
        "model": {k: (row.get("model") or {}).get(k) for k in ("d_model", "num_layers", "num_heads", "d_ff")},
        "setup": {k: cfg.get(k) for k in SETUP_FIELDS},
        "environment": row.get("environment"), "command": command, "run_dir": str(run_dir),
    }
    if row.get("control_of"):
        rec["control_of"] = row["control_of"]
    rec.update(extra or {})
    return rec


# --- the study -------------------------------------------------------------------------------------------


def _seed_done(names: list[str], summary: list[dict[str, Any]], dataset: str, seed: int) -> bool:
    have = {r["arm"]: r for r in summary if r["dataset"] == dataset and r["seed"] == seed}
    return all(n in have and (Path(have[n]["run_dir"]) / "metrics.json").is_file() for n in names)


def _finished_runs(out: Path, dataset: str, summary: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any],
                                                                                        tuple[str, ...]]]:
    """Every finished run a study of ``dataset`` would reuse or combine: its run folders under ``out`` and the
    summary's records, with their saved settings and the fields each arm sets itself."""
    def varies(arm: str) -> tuple[str, ...]:
        per_arm = ("seed", "method", "method_options")
        return per_arm + ("budget_cost",) if arm.startswith("budgetformer_cost") else per_arm

    runs = {str(f.parent): (json.loads(f.read_text()).get("config") or {}, varies(f.parent.name))
            for f in sorted((out / dataset).glob("seed*/*/metrics.json"))}
    for r in summary:
        if r.get("dataset") == dataset and str(r.get("run_dir")) not in runs:
            runs[str(r.get("run_dir"))] = (r.get("setup") or {}, varies(str(r.get("arm"))))
    return [(label, found, allowed) for label, (found, allowed) in runs.items()]


def run_study(cfg: RunConfig, out: Path, seeds: list[int], plan: StudyPlan, summary_path: Path,
              command: str | None = None, log: Any = None) -> list[dict[str, Any]]:
    """Every arm of ``plan`` for every seed on ``cfg.dataset``; returns this dataset's summary records."""
    command = command or "condcomp " + " ".join(sys.argv[1:])
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if cfg.budget_cost != 0 and "budgetformer" in plan.arms:
        log(f"note: the main budgetformer arm trains with --budget-cost {cfg.budget_cost}, not the paper's loss")
    names = plan.arm_names()
    base = RunConfig.from_dict({**cfg.to_dict(), "test_seed": 1 if cfg.test_seed is None else cfg.test_seed})
    fresh = (f"give another --out (now {out}; its summary.json goes with it)" if summary_path == out / "summary.json"
             else f"give another --out and --summary (now {out} and {summary_path})")
    check_same_settings(base, _finished_runs(out, cfg.dataset, load_summary(summary_path)),
                        f"{fresh}, or delete those runs and their records")
    for seed in seeds:
        scfg = RunConfig.from_dict({**base.to_dict(), "seed": seed})
        sdir = out / cfg.dataset / f"seed{seed}"
        if _seed_done(names, load_summary(summary_path), cfg.dataset, seed):
            log(f"{cfg.dataset} seed {seed}: every arm done, skipped")
            continue
        log(f"{cfg.dataset} seed {seed}: arms {names} -> {sdir}")
        study = Study(scfg, sdir)

        def done(arm: str, extra: dict[str, Any] | None = None, run: str | None = None, _study: Study = study,
                 _sdir: Path = sdir, _seed: int = seed) -> None:
            rec = record(_study.rows[arm], cfg.dataset, arm, _seed, command, _sdir / (run or arm), extra)
            if arm.startswith("budgetformer") and "control_of" not in rec:
                rec["difficulty"] = difficulty(_sdir / arm, _sdir / "standard") or _same_run_difficulty(
                    summary_path, rec)
                rec["adaptivity"] = run_adaptivity(_sdir / arm, _sdir / "standard", rec["model"]["num_heads"])
            upsert(summary_path, [rec])
            write_statistics(summary_path, out)
            log(f"{cfg.dataset} seed {_seed} {arm}: accuracy {rec['accuracy']:.4f}, heads {rec['heads']:.3f}"
                + (" (reused)" if _study.reused.get(arm) else ""))

        need_bf = any(n in names for n in ("budgetformer", "fixed_matched") + LAYER_ARMS + CONTROLS)
        if "standard" in names:  # first: it is the difficulty proxy of the budget arms (their loss per example)
            study.train("standard", "standard")
            done("standard")
        matched = None
        if need_bf:
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
                done("budgetformer", {"control_mode_k": None if mode_k is None else {
                    "accuracy": mode_k["accuracy"], "heads": mode_k["k_frac"],
                    "accuracy_lost": bf["accuracy"] - mode_k["accuracy"]}})
            if "budgetformer_mode_k" in names:
                done("budgetformer_mode_k", {"budgets": budgets})
            matched = matched_fraction(bf["k_frac"], H, rounding="nearest")
            layer_heads = {n: min(float(H), max(1.0, v["k_frac"] * H)) for n, v in bf["layers"].items()}
            for arm, routing in (("fixed_per_layer", "learned"), ("random_routing", "random")):
                if arm in names:
                    study.train(arm, "fixed_layers", {"heads": layer_heads, "routing": routing})
                    done(arm, {"layer_heads": layer_heads})
        if "fixed_matched" in names:
            assert matched is not None
            run = f"fixed_{matched:g}"
            study.train(run, "fixed", {"fraction": matched})
            study.rows["fixed_matched"] = study.rows[run]
            done("fixed_matched", {"matched_fraction": matched}, run=run)
        if "moh" in names:
            study.train("moh", "moh", plan.moh)
            done("moh")
        for arm, kw in (("budgetformer_random_heads", {"router": "random"}),
                        ("budgetformer_forced_matched", {"policy": "fixed", "fraction": matched}),
                        ("budgetformer_all_heads", {"policy": "full"})):
            if arm in names:
                study.control(arm, "budgetformer", **kw)
                done(arm, {"matched_fraction": matched} if arm.endswith("matched") else None)
        for f in plan.sweep_fractions:
            arm = f"fixed_{f:g}"
            if math.isclose(f, 1.0):
                study.rows[arm] = study.rows["standard"]
                done(arm, {"alias_of": "standard", "fraction": 1.0}, run="standard")
                continue
            study.train(arm, "fixed", {"fraction": f})
            done(arm, {"fraction": f})
        for c in plan.budget_costs:
            arm = f"budgetformer_cost{c:g}"
            study.train(arm, "budgetformer", plan.budgetformer, overrides={"budget_cost": c})
            done(arm, {"budget_cost": c})
        for k in plan.moh_topk:
            arm = f"moh_k{k}"
            study.train(arm, "moh", {**plan.moh, "top_k": k})
            done(arm, {"top_k": k})
        if not all(study.reused.get(n, True) for n in study.rows):
            # Re-time every arm of this seed round-robin, so that all see the same machine load.
            study.paired_timing(scfg.latency_reps)
            current = {r["arm"]: r for r in load_summary(summary_path)
                       if r["dataset"] == cfg.dataset and r["seed"] == seed}
            recs = []
            for arm, rec in current.items():
                timed = study.rows.get(arm)
                if timed is None or timed.get("latency_b1") is None:
                    continue
                rec.update({"latency_b1_s": timed["latency_b1"], "latency_b64_s": timed["latency_b64"],
                            "latency_paired": bool(timed.get("latency_paired"))})
                recs.append(rec)
            upsert(summary_path, recs)
            write_statistics(summary_path, out)  # the re-timed latencies, from the same records
    return [r for r in load_summary(summary_path) if r["dataset"] == cfg.dataset]


# --- statistics ------------------------------------------------------------------------------------------


def write_statistics(summary_path: Path, out: Path | None = None) -> dict[str, Any]:
    """Recompute ``statistics.json`` beside the summary from its records (see :mod:`study_stats`)."""
    from condcomp.experiments.classification.study_stats import merge_kept, statistics

    with _locked(summary_path):
        path = summary_path.parent / "statistics.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        new = merge_kept(statistics(load_summary(summary_path)), old)
        write_json(path, _rounded(new))
        return new
