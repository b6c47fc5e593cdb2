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
- controls on the trained BudgetFormer model, no retraining: ``budgetformer_random_heads`` (random heads at its
  learned budget), ``budgetformer_forced_matched`` (forced to the matched fixed fraction),
  ``budgetformer_all_heads``.
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
from condcomp.experiments.ablate import Study, matched_fraction
from condcomp.experiments.runconfig import RunConfig, check_same_settings
from condcomp.experiments.runner import write_json

MAIN_ARMS = ("standard", "budgetformer", "fixed_matched", "moh")
CONTROLS = ("budgetformer_random_heads", "budgetformer_forced_matched", "budgetformer_all_heads")
DEFAULT_ARMS = MAIN_ARMS + ("budgetformer_random_heads",)
# Paired comparisons on the test predictions: (arm a, arm b); the first is the question of the study.
COMPARISONS = (("budgetformer", "fixed_matched"), ("budgetformer", "standard"), ("moh", "standard"),
               ("budgetformer", "budgetformer_random_heads"))
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
        valid = set(MAIN_ARMS) | set(CONTROLS)
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
                rec["difficulty"] = difficulty(_sdir / arm, _sdir / "standard")
            upsert(summary_path, [rec])
            write_statistics(summary_path, out)
            log(f"{cfg.dataset} seed {_seed} {arm}: accuracy {rec['accuracy']:.4f}, heads {rec['heads']:.3f}"
                + (" (reused)" if _study.reused.get(arm) else ""))

        need_bf = any(n in names for n in ("budgetformer", "fixed_matched") + CONTROLS)
        if "standard" in names or any(n.startswith("budgetformer") for n in names):
            study.train("standard", "standard")  # the difficulty proxy of the budget arms
            if "standard" in names:
                done("standard")
        matched = None
        if need_bf:
            bf = study.train("budgetformer", "budgetformer", plan.budgetformer)
            if "budgetformer" in names:
                done("budgetformer")
            matched = matched_fraction(bf["k_frac"], int(bf["model"]["num_heads"]), rounding="nearest")
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
    return [r for r in load_summary(summary_path) if r["dataset"] == cfg.dataset]


# --- statistics ------------------------------------------------------------------------------------------


def _correct(run_dir: Path) -> list[bool] | None:
    f = run_dir / "examples.json"
    return json.loads(f.read_text())["correct"] if f.is_file() else None


def statistics(records: list[dict[str, Any]], out: Path | None = None) -> dict[str, Any]:
    """Per dataset: every arm's mean and 95 % interval over seeds; paired tests where the run folders hold the
    per-example predictions of both arms for the same seeds."""
    result: dict[str, Any] = {}
    for ds in sorted({r["dataset"] for r in records}):
        rows = [r for r in records if r["dataset"] == ds]
        arms: dict[str, Any] = {}
        for arm in sorted({r["arm"] for r in rows}):
            rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["seed"])
            arms[arm] = {"seeds": [r["seed"] for r in rs]}
            for key in ("accuracy", "heads", "s_mean", "flop_fraction", "latency_b1_s", "latency_b64_s",
                        "peak_inference_memory_b64_bytes", "inference_gco2"):
                vals = [r[key] for r in rs if r.get(key) is not None]
                arms[arm][key] = S.mean_ci(vals)
        comps = {}
        for a, b in COMPARISONS:
            by_seed = {r["seed"]: r for r in rows if r["arm"] == a}
            pairs = []
            for r in rows:
                if r["arm"] == b and r["seed"] in by_seed:
                    ca, cb = _correct(Path(by_seed[r["seed"]]["run_dir"])), _correct(Path(r["run_dir"]))
                    if ca is not None and cb is not None and len(ca) == len(cb):
                        pairs.append((r["seed"], ca, cb))
            if not pairs:
                continue
            pairs.sort()
            if len({len(p[1]) for p in pairs}) > 1:
                sizes = ", ".join(f"seed {p[0]}: {len(p[1])}" for p in pairs)
                dirs = sorted(r["run_dir"] for r in rows if r["arm"] in (a, b))
                raise ValueError(f"{ds}: {a} vs {b}: the seeds' runs were scored on different test sets ({sizes} "
                                 f"examples), so they cannot be paired; their settings differ. Runs: "
                                 f"{', '.join(dirs)}. Rerun them with one set of settings into a fresh --out and "
                                 "--summary, or remove the odd seeds' records from the summary")
            boot = S.paired_bootstrap([p[1] for p in pairs], [p[2] for p in pairs])
            comps[f"{a}_vs_{b}"] = {
                "a": a, "b": b, "seeds": [p[0] for p in pairs], "bootstrap": boot,
                "verdict": S.verdict(boot["lo"], boot["hi"]),
                "mcnemar": {str(p[0]): S.mcnemar(p[1], p[2]) for p in pairs},
                "heads_a": S.mean_ci([by_seed[p[0]]["heads"] for p in pairs])["mean"],
                "heads_b": S.mean_ci([r["heads"] for r in rows if r["arm"] == b and r["seed"] in
                                      {p[0] for p in pairs}])["mean"],
            }
        result[ds] = {"arms": arms, "comparisons": comps}
    return result


def write_statistics(summary_path: Path, out: Path | None = None) -> dict[str, Any]:
    """Recompute ``statistics.json`` beside the summary; comparisons whose run folders are gone are kept."""
    with _locked(summary_path):
        return _write_statistics(summary_path, out)


def _write_statistics(summary_path: Path, out: Path | None) -> dict[str, Any]:
    path = summary_path.parent / "statistics.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    records = load_summary(summary_path)
    new = statistics(records, out)
    have = {(r["dataset"], r["arm"], r["seed"]) for r in records}
    for ds, st in new.items():
        for name, comp in (old.get(ds) or {}).get("comparisons", {}).items():
            # kept only while both arms' records of its seeds are still in the summary (not stale)
            current = all((ds, arm, s) in have for arm in (comp["a"], comp["b"]) for s in comp["seeds"])
            if name not in st["comparisons"] and current:
                st["comparisons"][name] = comp
    write_json(path, new)
    return new
