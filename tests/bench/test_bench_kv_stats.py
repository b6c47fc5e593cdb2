"""``bench kv``'s paired statistics against formulas written here from scratch in float64, and the summary."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

pytest.importorskip("scipy")
Z95 = 1.959963984540054  # the normal's 0.975 quantile
Z90 = 1.6448536269514722  # its 0.95 quantile


def wilson_ref(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


@pytest.mark.parametrize(("k", "n"), [(0, 10), (9, 10), (50, 100), (100, 100)])
def test_wilson(k: int, n: int) -> None:
    from condcomp.bench.kv_stats import wilson

    assert wilson(k, n) == pytest.approx(wilson_ref(k, n), abs=1e-9)


def test_wilson_refuses_impossible_counts() -> None:
    from condcomp.bench.kv_stats import wilson

    with pytest.raises(ValueError, match="0 <= hits <= n"):
        wilson(3, 2)


def pairs(both: int, a_only: int, b_only: int, neither: int) -> tuple[list[bool], list[bool]]:
    a = [True] * both + [True] * a_only + [False] * b_only + [False] * neither
    b = [True] * both + [False] * a_only + [True] * b_only + [False] * neither
    return a, b


@pytest.mark.parametrize("table", [(4, 2, 2, 1), (36, 12, 2, 0), (80, 3, 9, 8), (10, 0, 0, 0)])
def test_paired_difference_is_newcombes_method_10(table: tuple[int, int, int, int]) -> None:
    from condcomp.bench.kv_stats import paired_difference_interval

    e, f, g, h = table  # both right, only a, only b, neither (Newcombe's a, b, c, d)
    n = sum(table)
    p1, p2 = (e + f) / n, (e + g) / n
    l1, u1 = wilson_ref(e + f, n)
    l2, u2 = wilson_ref(e + g, n)
    denom = (e + f) * (g + h) * (e + g) * (f + h)
    phi = (e * h - f * g) / math.sqrt(denom) if denom else 0.0
    lo = p1 - p2 - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0))
    hi = p1 - p2 + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0))
    got = paired_difference_interval(*pairs(*table))
    assert got == pytest.approx((p1 - p2, lo, hi), abs=1e-9)
    assert got[1] <= got[0] <= got[2]


def test_noninferiority_bound_and_margin() -> None:
    from condcomp.bench.kv_stats import KVStats, noninferiority

    same = pairs(90, 0, 0, 10)[0]
    assert noninferiority(same, same)["non_inferior"]  # identical answers: no loss
    lost, dense = pairs(80, 0, 10, 10)  # the variant loses 10 of dense's 90 cases
    t = noninferiority(lost, dense)
    assert t["diff"] == pytest.approx(-0.10) and t["lower"] < -0.10 and not t["non_inferior"]
    assert noninferiority(lost, dense, KVStats(margin=0.25))["non_inferior"]
    with pytest.raises(ValueError, match="same cases"):
        noninferiority(lost, dense[:-1])


def test_ppl_ratio_against_a_hand_bootstrap() -> None:
    np = pytest.importorskip("numpy")
    from condcomp.bench.kv_stats import KVStats, ppl_ratio

    rng = random.Random(0)
    dense = [[rng.uniform(1, 5) for _ in range(64)] for _ in range(3)]
    variant = [[x + rng.gauss(0.05, 0.3) for x in w] for w in dense]
    q = ppl_ratio(variant, dense, KVStats(reps=4000))
    diffs = np.array([v - d for vw, dw in zip(variant, dense) for v, d in zip(vw, dw)], dtype=np.float64)
    assert q["ratio"] == pytest.approx(math.exp(diffs.mean()), rel=1e-12)
    gen = np.random.default_rng(1)  # another stream: the intervals agree to the bootstrap's noise
    means = np.exp(diffs[gen.integers(0, diffs.size, (20000, diffs.size))].mean(1))
    assert q["lo"] == pytest.approx(np.quantile(means, 0.025), abs=0.01)
    assert q["hi"] == pytest.approx(np.quantile(means, 0.975), abs=0.01)
    shifted = ppl_ratio([[x + 0.1 for x in w] for w in dense], dense)
    assert shifted["lo"] == pytest.approx(math.exp(0.1)) and shifted["hi"] == pytest.approx(math.exp(0.1))
    with pytest.raises(ValueError, match="same tokens"):
        ppl_ratio(variant[:2], dense)
    with pytest.raises(ValueError, match="non-finite"):
        ppl_ratio([[math.inf] * 64, *variant[1:]], dense)


def _record(variant: str, hits: list[bool], nll: float, frac: float) -> dict:
    return {"variant": variant, "prompt_len": 1024, "kv_frac": frac, "kv_bytes": int(frac * 2**20),
            "ppl": math.exp(nll),
            "retrieval_acc": sum(hits) / len(hits), "retrieval_correct": hits, "token_nll": [[nll] * 8],
            "decode_ms_per_token": None, "decode_ratio": None, "decode_prompt": None, "note": ""}


def test_summary_pairs_every_variant_with_dense_and_the_best_press(tmp_path: Path) -> None:
    from condcomp.bench.kv_report import family, summary, write

    dense = _record("dense", [True] * 9 + [False], 2.0, 1.0)
    press = _record("kvpress-snapkv-0.50", [True] * 4 + [False] * 6, 2.1, 0.5)
    weak = _record("kvpress-knorm-0.50", [True] + [False] * 9, 2.2, 0.5)
    split = _record("split-duo-1of3", [True] * 7 + [False] * 3, 2.02, 0.5)
    result = {"preset": {"prompts": [1024], "passkey_cases": 10, "ppl_cases": 1, "cont_len": 8, "task": "facts",
                         "facts": 4, "decode_prompt": 0, "decode_batch": 0, "decode_tokens": 0},
              "device": "cpu", "threads": 1, "records": [dense, press, weak, split], "skipped": {}, "text": "builtin"}
    text = summary(result)
    row = next(line for line in text.splitlines() if line.startswith("| 1024 | split-duo-1of3 | 0.500 | 7 / 10"))
    # vs dense: 0 only it / 2 only dense -> p = 2 * (1/4) = 0.5; vs the best press (snapkv, 4): 3 / 0 -> 2 / 8
    assert "0 / 2, p 0.500" in row and "3 / 0 (kvpress-snapkv-0.50), p 0.250" in row
    assert f"{math.exp(0.02):.3f} [{math.exp(0.02):.3f}, {math.exp(0.02):.3f}]" in row
    best = next(line for line in text.splitlines() if line.startswith("| 1024 | kvpress-snapkv-0.50 | 0.500 | 4"))
    assert best.split(" | ")[7] == "-" and "within 5 points" in text  # the best press is not tested against itself
    assert family("split-duo-1of3") == "condcomp split" and family("dense") == "dense"
    assert family("adakv-0.25") == family("snapkv-0.50") == "condcomp token selection"
    write(tmp_path, result)
    assert (tmp_path / "summary.md").read_text() == text


def test_a_variant_is_tested_against_the_best_press_holding_at_least_its_bytes() -> None:
    """A press at fewer bytes is no equal-bytes competitor: the split at 0.5 meets the best press at >= 0.5 (3 of
    10), and the split at 0.25 the best at >= 0.25 (the 0.25 press, 6 of 10, more than the 0.5 one)."""
    from condcomp.bench.kv_report import statistics_table

    records = [_record("dense", [True] * 10, 2.0, 1.0),
               _record("kvpress-snapkv-0.50", [True] * 3 + [False] * 7, 2.1, 0.5),
               _record("kvpress-streaming-0.25", [True] * 6 + [False] * 4, 2.1, 0.25),
               _record("split-duo-1of3", [True] * 8 + [False] * 2, 2.0, 0.5),
               _record("split-duo-1of6-w92", [True] * 8 + [False] * 2, 2.0, 0.248)]
    rows = {line.split(" | ")[1]: line for line in statistics_table(records).splitlines()[2:]}
    assert "5 / 0 (kvpress-snapkv-0.50), p 0.062" in rows["split-duo-1of3"]  # 2 * 0.5**5
    assert "2 / 0 (kvpress-streaming-0.25), p 0.500" in rows["split-duo-1of6-w92"]


def test_the_pareto_set_is_the_undominated_records_by_hand(tmp_path: Path) -> None:
    """Dense (1.0, 9), a split at 0.5 (7) and a press at 0.5 (4, dominated), a split at 0.248 with 7 (dominates the
    0.5 split: fewer bytes, as many keys), a tie at 0.248 / 7 (both stay), a quantized split at 0.127 (5) and a
    variant with no retrieval results (left out); at another length a lone record is its own set."""
    from condcomp.bench.kv_report import pareto, plot, summary

    records = [_record("dense", [True] * 9 + [False], 2.0, 1.0),
               _record("split-duo-1of3", [True] * 7 + [False] * 3, 2.02, 0.5),
               _record("kvpress-snapkv-0.50", [True] * 4 + [False] * 6, 2.1, 0.5),
               _record("split-duo-1of6-w92", [True] * 7 + [False] * 3, 2.05, 0.248),
               _record("split-duo-1of12-w180", [False] * 3 + [True] * 7, 2.05, 0.248),
               _record("split-duo-1of3+fp8", [True] * 5 + [False] * 5, 2.03, 0.127),
               {**_record("streaming", [True], 2.0, 0.2), "retrieval_acc": math.nan, "retrieval_correct": None},
               {**_record("dense", [True, False], 2.0, 1.0), "prompt_len": 2048}]
    got = [(r["prompt_len"], r["variant"]) for r in pareto(records)]
    assert got == [(1024, "split-duo-1of3+fp8"), (1024, "split-duo-1of6-w92"), (1024, "split-duo-1of12-w180"),
                   (1024, "dense"), (2048, "dense")]
    result = {"preset": {"prompts": [1024], "passkey_cases": 10, "ppl_cases": 1, "cont_len": 8, "task": "facts",
                         "facts": 4, "decode_prompt": 0, "decode_batch": 0, "decode_tokens": 0},
              "device": "cpu", "threads": 1, "records": records[:6], "skipped": {}, "text": "builtin"}
    text = summary(result)
    assert "- 1024: `split-duo-1of3+fp8` 0.127x, 0.50 (10 cases)" in text and "`kvpress-snapkv-0.50` 0.500x" not in text
    pytest.importorskip("matplotlib")
    assert plot(records[:6], tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
