"""A user's arms (``router_<key>`` / ``policy_<key>``) in the study statistics: each is paired with the built-in
arm that differs only in that component, the paired difference and its interval equal a computation written
here with numpy and scipy, and the results page and the Pareto plot name them as the user's, not as controls."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
sps = pytest.importorskip("scipy.stats")

from condcomp.experiments.classification.ablation_stats import statistics  # noqa: E402

# made-up test accuracies per arm and seed (no two differences alike, so a mispairing changes the numbers)
ACC = {"standard": [0.900, 0.905, 0.910], "budgetformer": [0.850, 0.862, 0.871],
       "fixed_matched": [0.840, 0.846, 0.855], "router_first_heads": [0.811, 0.829, 0.832],
       "policy_half_budget": [0.861, 0.858, 0.880]}


def _record(arm: str, seed: int, run_dir: Path) -> dict[str, Any]:
    return {"dataset": "my_tickets", "arm": arm, "seed": seed, "accuracy": ACC[arm][seed],
            "heads": 1.0 if arm == "standard" else 0.5, "s_mean": 0.5, "flop_fraction": 0.7,
            "latency_b1_s": 0.001, "latency_b64_s": 0.01, "peak_inference_memory_b64_bytes": 2**20,
            "inference_gco2": None, "run_dir": str(run_dir), "n_test": 100, "n_train": 400, "train_steps": 39,
            "model": {"num_layers": 2, "num_heads": 4, "d_model": 32, "d_ff": 64},
            "setup": {"max_len": 32, "batch_size": 16, "lr": 1e-3, "threads": 1}, "method_options": {},
            "command": "condcomp ablate --dataset files --train-file mine.csv --router-arms first_heads"}


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    return [_record(arm, seed, tmp_path / "gone") for arm in ACC for seed in range(3)]


def _t_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean paired difference and its 95 % Student t interval, from numpy and scipy's t distribution."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    half = float(sps.t.ppf(0.975, len(d) - 1)) * float(d.std(ddof=1)) / math.sqrt(len(d))
    return float(d.mean()), float(d.mean()) - half, float(d.mean()) + half


@pytest.mark.parametrize(("user", "builtin"), [("router_first_heads", "fixed_matched"),
                                               ("policy_half_budget", "budgetformer")])
def test_a_user_arm_is_paired_with_the_builtin_arm_it_differs_from(tmp_path: Path, user: str, builtin: str) -> None:
    comps = statistics(_records(tmp_path))["my_tickets"]["comparisons"]
    comp = comps[f"{user}_vs_{builtin}"]
    assert comp["user_arm"] is True and (comp["a"], comp["b"]) == (user, builtin)
    mean, lo, hi = _t_interval(ACC[user], ACC[builtin])
    t = comp["seed_t"]
    assert (t["mean"], t["lo"], t["hi"]) == pytest.approx((mean, lo, hi), abs=1e-12)
    assert t["p"] == pytest.approx(float(sps.ttest_rel(ACC[user], ACC[builtin]).pvalue), rel=1e-9)
    assert comp["verdict"]  # the claim words the report prints


def test_user_arms_are_paired_only_with_their_counterpart(tmp_path: Path) -> None:
    comps = statistics(_records(tmp_path))["my_tickets"]["comparisons"]
    user_pairs = {name for name, c in comps.items() if c.get("user_arm")}
    assert user_pairs == {"router_first_heads_vs_fixed_matched", "policy_half_budget_vs_budgetformer"}
    assert not comps["budgetformer_vs_fixed_matched"].get("user_arm")  # a built-in comparison is not flagged


def test_without_the_counterpart_there_is_no_comparison(tmp_path: Path) -> None:
    records = [r for r in _records(tmp_path) if r["arm"] != "fixed_matched"]
    comps = statistics(records)["my_tickets"]["comparisons"]
    assert not any(name.startswith("router_") for name in comps)
    assert "policy_half_budget_vs_budgetformer" in comps


def test_the_report_shows_user_arms_verdict_rows_and_calls_them_yours(tmp_path: Path) -> None:
    from condcomp.experiments.classification.study_page import render_study_page

    folder = tmp_path / "my_study"
    folder.mkdir()
    records = _records(tmp_path)
    (folder / "summary.json").write_text(json.dumps(records))
    stats = statistics(records)
    (folder / "statistics.json").write_text(json.dumps(stats))
    page = render_study_page(folder, plots=False)
    section = page.split("### Does your component beat the built-in one?")[1].split("\n## ")[0]
    for name in ("router_first_heads_vs_fixed_matched", "policy_half_budget_vs_budgetformer"):
        comp = stats["my_tickets"]["comparisons"][name]
        row = next(line for line in section.splitlines() if f"{comp['a']} - {comp['b']} |" in line)
        mean = _t_interval(ACC[comp["a"]], ACC[comp["b"]])[0]
        assert f"{100 * mean:+.2f} [" in row and row.rstrip(" |").endswith(comp["verdict"])
    arms_line = page.split("Arms:")[1].split("\n")[0]
    assert "your components, not controls: `policy_half_budget`, `router_first_heads`" in arms_line
    assert "router_first_heads vs fixed_matched" not in page  # not repeated among "other" comparisons


def test_the_pareto_plot_puts_user_arms_in_their_own_family_not_control() -> None:
    from condcomp.experiments.classification.plots import _STYLES, _arm_family

    for arm in ("router_first_heads", "policy_half_budget"):
        assert _arm_family(arm) == "your router / policy" and _arm_family(arm) in _STYLES
    assert _arm_family("budgetformer_random_heads") == "control"
    assert _arm_family("random_routing") == "control"
