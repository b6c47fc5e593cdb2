"""The multi-seed study: statistics against hand computations, the resumable `condcomp ablate --seeds`, the summary
records, the results page, head selection frequencies, and the digits ViT data."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from condcomp.cli import main
from condcomp.experiments import stats as S


def test_mean_ci_is_the_student_t_interval() -> None:
    vals = [0.80, 0.83, 0.82]
    m = sum(vals) / 3
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / 2)
    got = S.mean_ci(vals)
    assert got["mean"] == pytest.approx(m)
    assert got["hi"] - got["mean"] == pytest.approx(4.3026527 * sd / math.sqrt(3))  # t(0.975, df 2) to 8 digits
    assert S.mean_ci([0.5])["lo"] is None and S.mean_ci([])["mean"] is None


def test_mcnemar_matches_the_binomial_tail_by_hand() -> None:
    a = [True] * 7 + [False] * 2 + [True] * 5  # 7 only-a, 2 only-b, 5 both right
    b = [False] * 7 + [True] * 2 + [True] * 5
    got = S.mcnemar(a, b)
    want = 2 * sum(math.comb(9, i) for i in range(3)) / 2**9  # P(X <= 2), X ~ Bin(9, 1/2), two-sided
    assert (got["a_only"], got["b_only"]) == (7, 2)
    assert got["p"] == pytest.approx(want)
    assert S.mcnemar([True, False], [True, False])["p"] == 1.0


def test_paired_bootstrap_interval_and_verdict() -> None:
    same = [[i % 3 == 0 for i in range(500)]] * 2
    b0 = S.paired_bootstrap(same, same, reps=200)
    assert (b0["diff"], b0["lo"], b0["hi"]) == (0.0, 0.0, 0.0)
    assert S.verdict(b0["lo"], b0["hi"]) == "no difference at this power"
    rng = random.Random(1)
    n = 4000
    a = [rng.random() < 0.80 for _ in range(n)]
    b = [x if rng.random() < 0.9 else not x for x in a]  # paired: mostly the same answers
    got = S.paired_bootstrap([a], [b], reps=1000)
    d = [int(x) - int(y) for x, y in zip(a, b)]
    mean = sum(d) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n)  # the normal approximation, independent
    assert got["diff"] == pytest.approx(mean)
    assert (got["hi"] - got["lo"]) == pytest.approx(2 * 1.96 * se, rel=0.2)
    better = S.paired_bootstrap([[True] * 300], [[i % 2 == 0 for i in range(300)]], reps=200)
    assert S.verdict(better["lo"], better["hi"]) == "better"
    assert S.verdict(-0.05, -0.01) == "worse"


def test_rank_correlation_with_ties_by_hand() -> None:
    assert S.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert S.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert S.pearson([1, 2, 3], [1, 1, 1]) is None  # constant: undefined, not 0
    x, y = [1.0, 2.0, 4.0, 7.0], [2.0, 1.0, 5.0, 6.0]
    mx, my = sum(x) / 4, sum(y) / 4
    want = sum((a - mx) * (b - my) for a, b in zip(x, y)) / math.sqrt(
        sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    assert S.pearson(x, y) == pytest.approx(want)
    bins = S.binned_means([5, 1, 3, 2, 4, 6], [50, 10, 30, 20, 40, 60], bins=3)
    assert [b["y_mean"] for b in bins] == [15, 35, 55]


TINY = ["--dataset", "synthetic", "--synthetic-train", "160", "--synthetic-test", "80", "--preset", "tiny",
        "--max-steps", "4", "--batch-size", "16", "--latency-reps", "1", "--threads", "1"]


@pytest.mark.slow
def test_ablate_seeds_is_resumable_and_writes_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, summary = tmp_path / "runs", tmp_path / "res" / "summary.json"
    args = ["ablate", *TINY, "--out", str(out), "--summary", str(summary), "--seeds", "0", "1",
            "--sweep-fractions", "0.5", "1", "--moh-topk", "1"]
    assert main(args) == 0
    records = json.loads(summary.read_text())
    arms = {"standard", "budgetformer", "fixed_matched", "moh", "budgetformer_random_heads", "fixed_0.5",
            "fixed_1", "moh_k1"}
    assert {(r["arm"], r["seed"]) for r in records} == {(a, s) for a in arms for s in (0, 1)}
    for r in records:
        for key in ("dataset", "arm", "seed", "accuracy", "heads", "s_mean", "flop_fraction", "latency_b1_s",
                    "latency_b64_s", "latency_executor", "peak_inference_memory_b64_bytes", "inference_gco2",
                    "inference_gco2_note", "command"):
            assert key in r, key
        assert r["command"].startswith("condcomp ablate") or r["command"].startswith("condcomp ")
        assert r["inference_gco2"] is None and "carbon" in r["inference_gco2_note"]
    fm = [r for r in records if r["arm"] == "fixed_matched"]
    bf = {r["seed"]: r for r in records if r["arm"] == "budgetformer"}
    for r in fm:  # matched: the head count nearest to the same seed's learned mean; run folder fixed_<f>
        H = r["model"]["num_heads"]
        k = bf[r["seed"]]["heads"] * H
        assert abs(r["matched_fraction"] * H - k) <= 0.5 and r["matched_fraction"] * H == int(r["matched_fraction"] * H)
        assert r["run_dir"].endswith(f"fixed_{r['matched_fraction']:g}")
    assert all(r["difficulty"] is not None for r in bf.values())
    st = json.loads((summary.parent / "statistics.json").read_text())
    comp = st["synthetic"]["comparisons"]["budgetformer_vs_fixed_matched"]
    assert comp["seeds"] == [0, 1] and comp["verdict"].startswith(
        ("detected", "not established", "matches", "no difference detected", "every seed"))
    assert comp["seed_t"]["df"] == 1 and comp["bootstrap"]["resampled"] == "examples"
    assert st["synthetic"]["arms"]["standard"]["accuracy"]["n"] == 2
    # Per-example predictions stay in the run folders, not in the summary.
    assert "correct" not in summary.read_text()
    ex = json.loads((out / "synthetic" / "seed0" / "moh" / "examples.json").read_text())
    assert {"pred", "loss", "length", "correct"} <= set(ex)
    # Again, plus a seed: the finished seeds are skipped, only seed 2 trains.
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.json")}
    capsys.readouterr()
    assert main(args + ["--seeds", "0", "1", "2"]) == 0  # the last --seeds wins
    err = capsys.readouterr().err
    assert "synthetic seed 0: every arm done, skipped" in err and "seed 1: every arm done" in err
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    assert len(json.loads(summary.read_text())) == 3 * len(arms)
    # The results page from the summary alone.
    try:
        import matplotlib  # noqa: F401
        plots: list[str] = []
    except ImportError:
        plots = ["--no-plots"]
    assert main(["report", str(summary.parent), "--doc", str(tmp_path / "doc" / "results.md"), *plots]) == 0
    page = (tmp_path / "doc" / "results.md").read_text()
    comp = json.loads((summary.parent / "statistics.json").read_text())["synthetic"]["comparisons"][
        "budgetformer_vs_fixed_matched"]  # over 3 seeds
    assert "Does a learned per-layer allocation beat a uniform one?" in page and comp["verdict"] in page
    assert "Can the learned budget reach the paper's regime" not in page  # the paper's goal: the project's pages
    # a user's own study: nothing of this repository's study (its datasets, its scripts) is stamped into it
    assert "ag_news: not run yet" not in page and "run_study.sh" not in page and "SPEC.md" not in page
    assert "issue" not in page.lower()
    assert f"condcomp report {summary.parent}" in page
    if not plots:  # one Pareto plot, one heatmap, one difficulty plot per dataset, linked from the page
        for name in ("pareto_synthetic.png", "heads_synthetic.png", "difficulty_synthetic.png",
                     "adaptivity_synthetic.png"):
            assert (summary.parent / "plots" / name).stat().st_size > 1000
            assert f"../res/plots/{name}" in page


def test_ablate_rejects_unknown_arms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ablate", *TINY, "--out", str(tmp_path), "--arms", "standard", "dense"]) == 2
    assert "unknown arm" in capsys.readouterr().err


def test_head_frequencies_add_up_to_the_heads_run() -> None:
    from condcomp.experiments.classification.runconfig import RunConfig, model_config, prepare
    from condcomp.experiments.classification.train import build_model, evaluate

    for method, opts, per_row in (("fixed", {"fraction": 0.5}, 2), ("moh", {"shared_heads": 1, "top_k": 2}, 3)):
        cfg = RunConfig(dataset="synthetic", synthetic_train=16, synthetic_test=40, preset="tiny", method=method,
                        method_options=opts)
        prep, _ = prepare(cfg)
        torch.manual_seed(0)
        model = build_model(model_config(cfg, prep), cfg)
        ev = evaluate(model, prep.test, 16)
        for layer, freq in ev["head_freq"].items():
            assert len(freq) == 4
            # every example (fixed) or real token (MoH) runs exactly per_row heads: the frequencies sum to it
            assert sum(freq) == pytest.approx(per_row), layer
        if method == "moh":
            assert all(f[0] == pytest.approx(1.0) for f in ev["head_freq"].values())  # the shared head


def test_digits_split_is_stratified_and_fixed() -> None:
    pytest.importorskip("sklearn", reason="digits need scikit-learn (extra 'vision')")
    from condcomp.experiments.classification.digit_tokens import prepare_digits

    a, b = prepare_digits(), prepare_digits()
    assert len(a["train"]) + len(a["test"]) == 1797
    assert torch.equal(a["test"].ids, b["test"].ids)
    counts = torch.bincount(a["test"].labels, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37  # ~20 % of ~180 per class
    assert a["train"].ids.shape[1] == 64 and int(a["train"].ids.min()) >= 1 and int(a["train"].ids.max()) <= 17
    assert bool(a["test"].mask.all())


def test_digits_without_scikit_learn_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def fake(name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if name.startswith("sklearn"):
            raise ImportError("no sklearn")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    from condcomp.experiments.digits import load_digits_arrays

    with pytest.raises(RuntimeError, match="scikit-learn"):
        load_digits_arrays()


def test_matched_fraction_rules() -> None:
    from condcomp.experiments.classification.seed_study import matched_fraction

    assert matched_fraction(0.630, 8, "nearest") == 5 / 8  # 5.04 heads: nearest 5, ceil 6
    assert matched_fraction(0.630, 8) == 6 / 8
    assert matched_fraction(0.5625, 8, "nearest") == 5 / 8  # 4.5 heads: halves go up
    assert matched_fraction(0.01, 8, "nearest") == 1 / 8  # at least one head
    with pytest.raises(ValueError, match="rounding"):
        matched_fraction(0.5, 8, "floor")


def test_ablate_with_the_difficulty_target_trains_it_into_the_learned_budget_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, summary = tmp_path / "runs", tmp_path / "summary.json"
    args = ["ablate", *TINY, "--out", str(out), "--summary", str(summary), "--method", "budgetformer",
            "--budget-target", "5", "--arms", "standard", "budgetformer", "fixed_per_layer"]
    assert main(args) == 0
    assert "--budget-target 5.0" in capsys.readouterr().err

    def saved(arm: str) -> float:
        return float(json.loads((out / "synthetic" / "seed0" / arm / "metrics.json").read_text())["config"][
            "budget_target"])

    assert (saved("budgetformer"), saved("standard"), saved("fixed_per_layer")) == (5.0, 0.0, 0.0)
    assert main(args) == 0  # the arms without the target are the same runs: reused, not refused
    assert "every arm done, skipped" in capsys.readouterr().err
    assert main(["train", *TINY, "--out", str(tmp_path / "f"), "--method", "fixed", "--budget-target", "1"]) == 2
    assert "has none" in capsys.readouterr().err


def test_fixed_arms_can_train_with_budgetformers_router_schedule(tmp_path: Path) -> None:
    """--share-router-schedule: fixed_matched and fixed_per_layer get BudgetFormer's topk options, so the study
    compares budgets, not router schedules; without it they keep the topk defaults."""
    from condcomp.routers.topk import TopKRouter

    import condcomp
    from condcomp.experiments.classification.methods import method_config

    schedule = {"mask_temperature": 1.0, "temperature": {"kind": "exponential", "start": 4.0, "end": 1.0}}
    cfg = method_config("fixed_layers", 8, {"heads": {"a": 1.5}, "routing": "learned", "router_options": schedule})
    assert cfg.router == ("topk", schedule)
    with pytest.raises(ValueError, match="routing='random' has no scorer"):
        method_config("fixed_layers", 8, {"heads": {"a": 1.5}, "routing": "random", "router_options": schedule})

    out, summary = tmp_path / "runs", tmp_path / "summary.json"
    opts = json.dumps({"s_min": 0.1, "s_max": 0.9, "router_options": schedule})
    args = ["ablate", *TINY, "--out", str(out), "--summary", str(summary), "--method", "budgetformer",
            "--method-options", opts, "--arms", "standard", "budgetformer", "fixed_matched", "fixed_per_layer",
            "random_routing", "--share-router-schedule"]
    assert main(args) == 0
    records = {r["arm"]: r for r in json.loads(summary.read_text())}
    assert records["fixed_per_layer"]["method_options"]["router_options"] == schedule
    assert records["fixed_matched"]["method_options"]["router_options"] == schedule
    assert records["fixed_matched"]["run_dir"].endswith("_shared_router")
    assert "router_options" not in records["random_routing"]["method_options"]
    # the trained fixed arm's routers really run BudgetFormer's schedule (0.25 is topk's default mask temperature)
    from condcomp.experiments.classification.model import EncoderClassifier, ModelConfig

    model = EncoderClassifier(ModelConfig(vocab_size=50, num_classes=2, d_model=32, num_heads=8, d_ff=64,
                                          num_layers=1, max_len=16))
    condcomp.apply_(model, method_config("fixed", 8, {"fraction": 0.25, "router_options": schedule}))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(r.mask_temperature == 1.0 for r in routers)
    assert float(routers[0].temperature(0.0)) == pytest.approx(4.0)


def test_a_seed_drawn_twice_gets_two_independent_example_resamples() -> None:
    """The two-stage bootstrap: with every seed holding the same differences, each replicate's mean is the mean of
    S independent example resamples, so its spread is one seed's over sqrt(S) (the normal approximation, by hand);
    reusing one resample for a seed drawn twice would leave it near one seed's."""
    rng = random.Random(3)
    n, seeds = 2000, 4
    a = [rng.random() < 0.8 for _ in range(n)]
    b = [x if rng.random() < 0.85 else not x for x in a]
    d = [int(x) - int(y) for x, y in zip(a, b)]
    mean = sum(d) / n
    se_one = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n)
    got = S.paired_bootstrap([a] * seeds, [b] * seeds, reps=2000)
    assert got["resampled"] == "seeds and examples" and got["diff"] == pytest.approx(mean)
    assert (got["hi"] - got["lo"]) == pytest.approx(2 * 1.96 * se_one / math.sqrt(seeds), rel=0.15)
    one = S.paired_bootstrap([a], [b], reps=2000)
    assert (one["hi"] - one["lo"]) == pytest.approx(2 * 1.96 * se_one, rel=0.15)
