"""The ablation study's summary: one record per dataset x arm x seed (``summary.json``, rewritten atomically under
a lock: several study jobs may share it), the difficulty and adaptivity a BudgetFormer record carries, and
``statistics.json`` recomputed beside it (:mod:`.ablation_stats`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from condcomp.experiments import stats as S
from condcomp.experiments.classification.adaptivity import adaptivity
from condcomp.experiments.classification.runner import write_json

# The run settings a record carries (the setup table of the results page; what makes two runs the same run).
SETUP_FIELDS = ("preset", "d_model", "num_layers", "num_heads", "d_ff", "max_len", "max_train", "max_test",
                "test_seed", "tokenizer", "epochs", "max_steps", "batch_size", "lr", "weight_decay", "warmup",
                "dropout", "pooling", "budget_cost", "budget_target", "threads", "latency_reps", "carbon_country")


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


def same_run_difficulty(summary_path: Path, rec: dict[str, Any]) -> dict[str, Any] | None:
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


def write_statistics(summary_path: Path, out: Path | None = None) -> dict[str, Any]:
    """Recompute ``statistics.json`` beside the summary from its records (see :mod:`.ablation_stats`)."""
    from condcomp.experiments.classification.ablation_stats import merge_kept, statistics

    with _locked(summary_path):
        path = summary_path.parent / "statistics.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        new = merge_kept(statistics(load_summary(summary_path)), old)
        write_json(path, _rounded(new))
        return new
