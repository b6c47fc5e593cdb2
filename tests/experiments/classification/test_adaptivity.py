"""The study's adaptivity measures, per-layer budgets, seed-level statistics and the new arms, against hand
computations and independent references."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from condcomp.experiments import stats as S
from condcomp.experiments.classification.adaptivity import adaptivity, entropy_bits, layer_adaptivity, mode_budgets
from condcomp.experiments.classification.layer_budget import ConstantBudgetPolicy, LayerMeanPolicy


def test_layer_adaptivity_by_hand() -> None:
    s, k, heads = [0.12, 0.21, 0.35, 0.95], [1, 1, 2, 7], [0b1, 0b1, 0b11, 0b1111111]
    got = layer_adaptivity(s, k, 8, heads)
    assert got["k_mode"] == 1 and got["k_off_mode"] == pytest.approx(0.5)
    assert got["k_hist"] == [0, 0.5, 0.25, 0, 0, 0, 0, 0.25, 0]
    assert got["s_hist"] == [0, 0.25, 0.25, 0.25, 0, 0, 0, 0, 0, 0.25]
    m = 11 / 4
    assert got["k_sd"] == pytest.approx(math.sqrt(sum((v - m) ** 2 for v in k) / 3))
    assert got["set_entropy_bits"] == pytest.approx(1.5)  # sets {1: 1/2, 3: 1/4, 127: 1/4}
    assert got["sets"] == 3 and got["top_set_share"] == 0.5
    same = layer_adaptivity([0.5] * 3, [4] * 3, 8, [15] * 3)
    assert same["k_off_mode"] == 0 and same["set_entropy_bits"] == 0 and same["s_sd"] == 0
    assert layer_adaptivity([0.1, 0.2], [2, 3], 8)["k_mode"] == 2  # a tie: the smaller k
    with pytest.raises(ValueError, match="equally long"):
        layer_adaptivity([0.1], [1, 2], 8)
    with pytest.raises(ValueError, match="empty"):
        entropy_bits([])


def test_run_adaptivity_any_layer_and_difficulty_by_hand() -> None:
    ex = {"s": [0.2, 0.4, 0.6, 0.8], "k_frac": [0.25, 0.25, 0.5, 0.75],
          "layers": {"a": {"s": [0.2, 0.4, 0.6, 0.8], "k": [2, 2, 2, 3]},
                     "b": {"s": [0.2, 0.4, 0.6, 0.8], "k": [1, 1, 5, 1]}}}
    got = adaptivity(ex, 8, difficulty=[3.0, 1.0, 2.0, 4.0])
    assert got["layers"]["a"]["k_off_mode"] == 0.25 and got["layers"]["b"]["k_off_mode"] == 0.25
    assert got["k_off_mode_any"] == 0.5  # examples 2 (layer b) and 3 (layer a)
    # ranks of difficulty 3, 1, 2, 4 against s ranks 1..4: d = 2, -1, -1, 0 -> 1 - 6 * 6 / (4 * 15) = 0.4
    assert got["spearman_difficulty_s"] == pytest.approx(0.4)
    assert mode_budgets(got) == {"a": [2.0, 0.5], "b": [1.0, 0.5]}
    assert adaptivity({"s": [0.1], "k_frac": [0.1]}, 8) is None
    with pytest.raises(ValueError, match="difficulty"):
        adaptivity(ex, 8, difficulty=[1.0])


def test_paired_t_by_hand_df2_closed_form() -> None:
    pytest.importorskip("scipy", reason="the seed-level test needs scipy (extra 'report')")
    d = [0.002, 0.004, 0.003]
    got = S.paired_t(d)
    sd = 0.001
    assert got["mean"] == pytest.approx(0.003) and got["sd"] == pytest.approx(sd) and got["df"] == 2
    assert got["hi"] - got["mean"] == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-5)
    t = 0.003 / (sd / math.sqrt(3))
    assert got["p"] == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-6)  # Student t, df 2: closed form
    assert S.paired_t([0.01])["lo"] is None
    assert "better" in S.seed_verdict(got)
    none = S.seed_verdict(S.paired_t([0.01, -0.01, 0.0]))
    assert none.startswith("no difference detected; differences above") and "points excluded" in none
    same = S.seed_verdict(S.paired_t([0.001, 0.001]))  # two seeds, the same 0.1 points: no spread, no test
    assert same.startswith("every seed differs by the same +0.10 points") and "better" not in same


def test_min_detectable_difference_has_80_percent_power_by_simulation() -> None:
    pytest.importorskip("scipy", reason="power needs scipy (extra 'report')")
    from scipy import stats as sps

    sd, n = 1.0, 3
    mdd = S.min_detectable_difference(sd, n)
    assert mdd is not None
    g = torch.Generator().manual_seed(0)
    x = mdd + sd * torch.randn(40_000, n, generator=g, dtype=torch.float64)  # seeds' differences at the MDD
    t = x.mean(1) / (x.std(1) / math.sqrt(n))
    power = float((t.abs() > sps.t.ppf(0.975, n - 1)).double().mean())
    assert power == pytest.approx(0.80, abs=0.01)
    # many seeds: the normal approximation (z_0.975 + z_0.8) sd / sqrt(n)
    assert S.min_detectable_difference(sd, 400) == pytest.approx((1.959964 + 0.841621) / 20, rel=0.01)
    assert S.min_detectable_difference(None, 3) is None and S.min_detectable_difference(0.0, 3) is None
    assert S.seeds_needed(0.0, 0.01) is None  # no spread: no estimate, not 'MDD 0'
    need = S.seeds_needed(0.01, 0.01)
    assert need is not None and S.min_detectable_difference(0.01, need) <= 0.01  # type: ignore[operator]
    assert S.min_detectable_difference(0.01, need - 1) > 0.01  # type: ignore[operator]


def test_layer_mean_policy_matches_a_fractional_mean() -> None:
    x = torch.zeros(1000, 2, 4)
    p = LayerMeanPolicy(num_heads=8, mean_heads=5.3)
    k = p.eval()(x, None).k
    assert set(k.tolist()) == {5, 6} and float(k.float().mean()) == pytest.approx(5.3, abs=0.005)
    assert torch.equal(k, p(x, None).k)  # evaluation is deterministic
    torch.manual_seed(0)
    kt = torch.cat([p.train()(x, None).k for _ in range(20)])
    assert float(kt.float().mean()) == pytest.approx(5.3, abs=0.02)
    assert LayerMeanPolicy(8, 3.0).eval()(x, None).k.unique().tolist() == [3]
    with pytest.raises(ValueError, match="mean_heads"):
        LayerMeanPolicy(8, 0.5)
    c = ConstantBudgetPolicy(8, 3, 0.41)(x, None)
    assert c.k.unique().tolist() == [3] and float(c.s[0]) == pytest.approx(0.41)


TINY = ["--dataset", "synthetic", "--synthetic-train", "160", "--synthetic-test", "80", "--preset", "tiny",
        "--max-steps", "4", "--batch-size", "16", "--latency-reps", "1", "--threads", "1"]


def test_ablate_layer_arms_and_the_mode_k_control(tmp_path: Path) -> None:
    from condcomp.cli import main

    out, summary = tmp_path / "runs", tmp_path / "summary.json"
    args = ["ablate", *TINY, "--out", str(out), "--summary", str(summary), "--seeds", "0", "--arms", "standard",
            "budgetformer", "budgetformer_mode_k", "fixed_per_layer", "random_routing"]
    assert main(args) == 0
    recs = {r["arm"]: r for r in json.loads(summary.read_text())}
    assert set(recs) == {"standard", "budgetformer", "budgetformer_mode_k", "fixed_per_layer", "random_routing"}
    bf, H = recs["budgetformer"], recs["budgetformer"]["model"]["num_heads"]
    ex = json.loads((out / "synthetic" / "seed0" / "budgetformer" / "examples.json").read_text())
    for name, layer in ex["layers"].items():  # the recorded measures against the per-example head counts
        counts = {k: layer["k"].count(k) for k in set(layer["k"])}
        mode = max(counts, key=lambda k: (counts[k], -k))
        assert bf["adaptivity"]["layers"][name]["k_mode"] == mode
        assert bf["adaptivity"]["layers"][name]["k_off_mode"] == pytest.approx(1 - counts[mode] / len(layer["k"]))
        assert recs["budgetformer_mode_k"]["layers"][name] == pytest.approx(mode / H)  # every example at the mode
        # the per-layer arms: trained and evaluated at the same layer's mean head count (rounded per example)
        assert recs["fixed_per_layer"]["layer_heads"][name] == pytest.approx(bf["layers"][name] * H, abs=1e-4)
        for arm in ("fixed_per_layer", "random_routing"):
            assert recs[arm]["layers"][name] * H == pytest.approx(bf["layers"][name] * H, abs=0.06)
    assert bf["control_mode_k"]["accuracy"] == recs["budgetformer_mode_k"]["accuracy"]
    assert recs["budgetformer_mode_k"]["control_of"] == "budgetformer"
    st = json.loads((tmp_path / "statistics.json").read_text())["synthetic"]["comparisons"]
    assert {"budgetformer_vs_fixed_per_layer", "budgetformer_vs_budgetformer_mode_k",
            "fixed_per_layer_vs_random_routing"} <= set(st)
    c = st["budgetformer_vs_fixed_per_layer"]
    assert c["diffs"] == [pytest.approx(bf["accuracy"] - recs["fixed_per_layer"]["accuracy"], abs=1e-6)]
    assert c["bootstrap"]["resampled"] == "examples"


def test_statistics_from_records_alone() -> None:
    pytest.importorskip("scipy", reason="the seed-level test needs scipy (extra 'report')")
    from condcomp.experiments.classification.ablation_stats import statistics

    recs = [{"dataset": "d", "arm": arm, "seed": s, "accuracy": acc, "heads": h, "run_dir": "/nonexistent"}
            for arm, h, accs in (("budgetformer", 0.6, (0.80, 0.82, 0.81)), ("fixed_matched", 0.625,
                                                                             (0.79, 0.80, 0.80)))
            for s, acc in enumerate(accs)]
    c = statistics(recs)["d"]["comparisons"]["budgetformer_vs_fixed_matched"]
    assert c["diffs"] == pytest.approx([0.01, 0.02, 0.01])
    assert c["seed_t"]["mean"] == pytest.approx(0.04 / 3) and c["heads_b"] == [0.625] * 3
    assert c["seed_t"]["mdd_80"] == pytest.approx(S.min_detectable_difference(c["seed_t"]["sd"], 3))
    assert "bootstrap" not in c  # no per-example predictions: no example bootstrap


def test_difficulty_of_the_same_run_is_carried_over_only_for_identical_runs(tmp_path: Path) -> None:
    from condcomp.experiments.classification.ablation_summary import same_run_difficulty

    old = {"dataset": "d", "arm": "budgetformer", "seed": 0, "accuracy": 0.889474, "s_mean": 0.688808,
           "setup": {"lr": 0.001}, "difficulty": {"loss": {"spearman_s": -0.18}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps([old]))
    same = {**old, "accuracy": 0.88947368, "s_mean": 0.68880756, "difficulty": None}  # unrounded, same run
    got = same_run_difficulty(path, same)
    assert got is not None and got["loss"]["spearman_s"] == -0.18 and "earlier record" in got["from"]
    assert same_run_difficulty(path, {**same, "accuracy": 0.8891}) is None  # another model
    assert same_run_difficulty(path, {**same, "seed": 1}) is None
    assert same_run_difficulty(path, {**same, "setup": {"lr": 0.002}}) is None


def test_signed_pull_policy_gives_every_example_the_same_weight() -> None:
    from condcomp.policies.budgetformer import BudgetFormerPolicy

    from condcomp.experiments.classification.signed_budget import SignedPullBudgetPolicy

    torch.manual_seed(0)
    signed = SignedPullBudgetPolicy(d_model=16, num_heads=8).train()
    plain = BudgetFormerPolicy(d_model=16, num_heads=8).train()
    plain.load_state_dict(signed.state_dict())
    x = torch.randn(4, 3, 16)
    pull = torch.tensor([3.0, -1.0, 0.5, -0.5])  # dL/ds_i; mean |.| = 1.25
    (signed(x, None).s * pull).sum().backward()
    (plain(x, None).s * torch.tensor([1.25, -1.25, 1.25, -1.25])).sum().backward()  # by hand
    for a, b in zip(signed.parameters(), plain.parameters()):
        assert a.grad is not None and torch.allclose(a.grad, b.grad)
    with torch.no_grad():  # evaluation: the same budget as the paper's policy
        assert torch.equal(signed.eval()(x, None).s, plain.eval()(x, None).s)
