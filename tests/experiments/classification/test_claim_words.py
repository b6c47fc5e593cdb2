"""The study pages' words follow the evidence (``study_page_claims.ClaimRule``), checked on made-up comparisons
against scipy's t distribution and binomial test, and a page for a user's own records carries none of this
project's notes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

sps = pytest.importorskip("scipy.stats")

from condcomp.experiments.classification.study_page_claims import ClaimRule, pooled_mcnemar  # noqa: E402


def _comp(diffs: list[float], boot: tuple[float, float] | None = None,
          mcnemar: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """A comparison as statistics.json holds it; the seed-level t computed here with scipy, from scratch."""
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = float(sps.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    c: dict[str, Any] = {"seeds": list(range(n)), "diffs": diffs,
                         "seed_t": {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}}
    if boot:
        c["bootstrap"] = {"lo": boot[0], "hi": boot[1], "resampled": "examples"}
    if mcnemar:
        c["mcnemar"] = mcnemar
    return c


def test_pooled_mcnemar_is_scipys_exact_binomial_test() -> None:
    per_seed = {"0": {"a_only": 135, "b_only": 121}, "1": {"a_only": 137, "b_only": 122},
                "2": {"a_only": 147, "b_only": 126}}
    got = pooled_mcnemar(per_seed)
    want = sps.binomtest(419, 419 + 369, 0.5).pvalue
    assert (got["a_only"], got["b_only"]) == (419, 369) and got["p"] == pytest.approx(want, rel=1e-9)


def test_a_seed_interval_the_test_examples_do_not_confirm_is_not_a_difference() -> None:
    """AG News' +0.22 [+0.10, +0.34] of the committed study: three seeds that agree closely, each seed's own
    McNemar test far from significant."""
    rule = ClaimRule()
    mc = {"0": {"a_only": 135, "b_only": 121}, "1": {"a_only": 137, "b_only": 122},
          "2": {"a_only": 147, "b_only": 126}}
    c = _comp([0.001842, 0.001974, 0.002763], mcnemar=mc)
    assert c["seed_t"]["lo"] > 0  # the seed-level interval alone excludes 0
    words = rule.words(c)
    assert words.startswith("not established") and "p = 0.081" in words and "better" not in words
    assert rule.words(_comp([0.001842, 0.001974, 0.002763], boot=(-0.0011, 0.0054))).startswith("not established")
    # no within-seed evidence at all: still not a detected difference
    assert "no within-seed evidence" in rule.words(_comp([0.001842, 0.001974, 0.002763]))


def test_detected_needs_both_in_the_same_direction_and_shows_both() -> None:
    rule = ClaimRule()
    c = _comp([0.012, 0.016, 0.014], boot=(0.009, 0.019))
    words = rule.words(c)
    lo, hi = c["seed_t"]["lo"], c["seed_t"]["hi"]
    assert words.startswith("detected: better") and f"[{100 * lo:+.2f}, {100 * hi:+.2f}]" in words
    assert "[+0.90, +1.90]" in words
    worse = rule.words(_comp([-0.012, -0.016, -0.014], mcnemar={"0": {"a_only": 10, "b_only": 60}}))
    assert worse.startswith("detected: worse") and "McNemar" in worse
    opposite = rule.words(_comp([-0.012, -0.016, -0.014], mcnemar={"0": {"a_only": 60, "b_only": 10}}))
    assert opposite.startswith("not established")


def test_matches_only_from_tost_with_the_margin_stated() -> None:
    rule = ClaimRule(margin=0.01)
    tight = _comp([0.001, -0.002, 0.0, 0.002, -0.001])
    n, m, sd = 5, 0.0, tight["seed_t"]["sd"]
    half90 = float(sps.t.ppf(0.95, n - 1)) * sd / math.sqrt(n)
    assert -0.01 < m - half90 and m + half90 < 0.01  # scipy's TOST: both one-sided tests reject at 5 %
    words = rule.words(tight)
    assert words.startswith("matches within +-1.00 points (TOST 5 %") and f"[{100 * -half90:+.2f}" in words
    # a wide interval that contains 0: no equivalence, and the page says how large a difference is not excluded
    wide = _comp([0.03, -0.02, 0.01])
    bound = 100 * max(abs(wide["seed_t"]["lo"]), abs(wide["seed_t"]["hi"]))
    assert rule.words(wide).startswith(f"no difference detected; differences up to {bound:.2f} points not excluded")
    assert rule.words(wide) != rule.words(tight)
    assert ClaimRule(margin=0.001).words(tight).startswith("no difference detected")  # a margin it cannot meet


def _record(arm: str, seed: int, acc: float, run_dir: Path, dataset: str = "my_tickets") -> dict[str, Any]:
    return {"dataset": dataset, "arm": arm, "seed": seed, "accuracy": acc, "heads": 0.5 if arm != "standard" else 1.0,
            "s_mean": 0.5, "flop_fraction": 0.7, "latency_b1_s": 0.001 * (1 + seed), "latency_b64_s": 0.01,
            "peak_inference_memory_b64_bytes": 2**20, "inference_gco2": None,
            "inference_gco2_note": "codecarbon not installed", "run_dir": str(run_dir), "n_test": 100,
            "n_train": 400, "train_steps": 39, "model": {"num_layers": 2, "num_heads": 4, "d_model": 32, "d_ff": 64},
            "setup": {"max_len": 32, "batch_size": 16, "lr": 1e-3, "threads": 1}, "method_options": {},
            "command": "condcomp ablate --dataset files --train-file mine.csv"}


def test_a_page_for_a_users_own_records_carries_none_of_the_projects_notes(tmp_path: Path) -> None:
    from condcomp.experiments.classification.ablation_stats import statistics
    from condcomp.experiments.classification.study_page import render_study_page

    folder = tmp_path / "my_study"
    folder.mkdir()
    records = [_record(arm, seed, 0.80 + 0.01 * seed + (0.005 if arm == "budgetformer" else 0.0), tmp_path / "gone")
               for arm in ("standard", "budgetformer", "fixed_matched") for seed in (0, 1, 2)]
    (folder / "summary.json").write_text(json.dumps(records))
    (folder / "statistics.json").write_text(json.dumps(statistics(records)))
    page = render_study_page(folder, plots=False)
    for project_note in ("How the training length was chosen", "Our numbers beside the paper's", "older computation",
                         "run folders are gone", "Departures from the paper", "results/reproduction",
                         "SNLI", "AG News", "Trained enough?", "paper's regime", "Missing for"):
        assert project_note not in page, project_note
    assert page.index("## Summary") < page.index("Arms:") < page.index("## The questions")  # the summary opens it
    assert page.count("pip install -e \".[carbon]\"") == 1 and "null:" not in page  # the carbon note, once
    assert "condcomp ablate --dataset files --train-file mine.csv" in page  # its own commands
    assert "[-" not in page.split("## Every arm")[1].split("| standard |")[1].split("\n")[0]  # latency: no bound < 0


def test_a_gco2_column_with_gaps_says_once_what_its_dashes_mean(tmp_path: Path) -> None:
    from condcomp.experiments.classification.ablation_stats import statistics
    from condcomp.experiments.classification.study_page import render_study_page

    folder = tmp_path / "my_study"
    folder.mkdir()
    records = [_record(arm, seed, 0.80 + 0.01 * seed, tmp_path / "gone")
               for arm in ("standard", "budgetformer", "fixed_matched") for seed in (0, 1, 2)]
    for r in records:
        if r["arm"] == "fixed_matched" and r["seed"] < 2:  # measured in two runs of one arm only
            r["inference_gco2"] = 0.02 + 0.01 * r["seed"]
    (folder / "summary.json").write_text(json.dumps(records))
    (folder / "statistics.json").write_text(json.dumps(statistics(records)))
    page = render_study_page(folder, plots=False)
    assert page.count("pip install -e \".[carbon]\"") == 1
    assert "7 of 9 runs were made without codecarbon" in page
    row = next(line for line in page.splitlines() if line.startswith("| fixed_matched |"))
    assert "| 0.025 |" in row  # the mean over the two runs that measured it: (0.02 + 0.03) / 2
    row = next(line for line in page.splitlines() if line.startswith("| budgetformer |"))
    assert row.split(" | ")[-2] == "-"


def test_the_projects_page_keeps_the_budget_goals_verdict_and_moves_its_run_tables_beside_the_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.experiments.classification import study_page
    from condcomp.experiments.classification.ablation_stats import statistics

    monkeypatch.setattr(study_page, "PROJECT_RESULTS", tmp_path / "results")  # make the folder one of "ours"
    folder = tmp_path / "results" / "study"
    folder.mkdir(parents=True)
    records = [_record(arm, seed, 0.80 + 0.01 * seed, tmp_path / "gone", dataset="ag_news")
               for arm in ("standard", "budgetformer", "fixed_matched") for seed in (0, 1, 2)]
    (folder / "summary.json").write_text(json.dumps(records))
    (folder / "statistics.json").write_text(json.dumps(statistics(records)))
    page = study_page.render_study_page(folder, doc=tmp_path / "docs" / "results.md", plots=False)
    full = (folder / "regime.md").read_text()
    run_row = "| AG News | budgetformer | 0 |"
    assert run_row in full and run_row not in page  # every run's row beside the records, not on the page
    assert "[regime.md](../results/study/regime.md)" in page
    assert page.count("### Verdict on the budget goal") == 1
    verdict = page.split("### Verdict on the budget goal")[1].split("\n## ")[0].strip()
    assert verdict and verdict in full  # the page's verdict is the full section's


def test_test_examples_that_exclude_0_without_the_seeds_are_not_a_match() -> None:
    """The target study's learned vs random routing on AG News (its committed per-seed differences and example
    bootstrap): the seed-level t interval (5 seeds) holds 0 and lies inside +-1 point by TOST, while the test
    examples exclude 0: "not established", never "matches"."""
    rule = ClaimRule()
    c = _comp([0.005921, 0.0025, 0.005131, -0.001185, 0.007236], boot=(0.00165789, 0.00618421))
    lo, hi = c["seed_t"]["lo"], c["seed_t"]["hi"]
    assert lo < 0 < hi  # scipy's 95 % t interval holds 0
    assert rule.equivalent(c["seed_t"]) is not None  # and the TOST at +-1 point holds
    words = rule.words(c)
    assert words.startswith("not established: the test examples exclude 0") and "matches" not in words
    assert "[+0.17, +0.62]" in words and f"[{100 * lo:+.2f}, {100 * hi:+.2f}]" in words and "by TOST" in words
    assert rule.label(c) == "within seeds only, not established"
    # the same seeds with examples that hold 0 too: the TOST then speaks
    assert rule.words(_comp([0.005921, 0.0025, 0.005131, -0.001185, 0.007236], boot=(-0.001, 0.006))).startswith(
        "matches")
