"""``condcomp.bench.gpu_tuning``: auto's CUDA thresholds fitted from a gpu-check record. The records here are
made up so that the right thresholds are known by construction (checked against ``GatheredTuning.prefers_dense``,
the rule auto applies), and the fit is compared with an exhaustive count written out separately."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from condcomp.bench.gpu_tuning import cell_wins, fit, tuning_fields, tuning_lines, tuning_record
from condcomp.executors.gathered import GatheredTuning

SHAPES = ((8, 2048, 2048, 32), (64, 512, 768, 12), (2, 128, 256, 8))
BUDGETS = (0.125, 0.25, 0.5, 1.0)


def _records(wins: Any, dtype: str = "bfloat16", passes: tuple[str, ...] = ("fwd", "fwd+bwd")) -> list[dict]:
    """Two records (gathered, masked) per cell and pass; gathered at 0.5x dense where ``wins(B, T, D, s, pass)``,
    else 2x; masked at 1.1x."""
    out = []
    for (B, T, D, H), s, gran, pas in itertools.product(SHAPES, BUDGETS, ("sequence", "token"), passes):
        for variant, ratio in (("gathered", 0.5 if wins(B, T, D, s, pas) else 2.0), ("masked", 1.1)):
            out.append({"shape": {"B": B, "T": T, "D": D, "H": H}, "granularity": gran, "s": s, "dtype": dtype,
                        "variant": variant, "pass": pas, "paired_to_dense": ratio})
    return out


def test_the_fit_recovers_thresholds_that_separate_wins_from_losses() -> None:
    # gathered wins when it skips at least 10 million of B*T*D work and keeps at most half the heads
    def wins(B: int, T: int, D: int, s: float, pas: str) -> bool:
        return (1 - s) * B * T * D >= 10e6 and s <= 0.5

    record = tuning_record(_records(wins))
    for gran in ("sequence", "token"):
        f = record["fits"][gran]
        assert f["agree"] == f["cells"] == len(SHAPES) * len(BUDGETS) and not f["disagree"]
    tuning = GatheredTuning(**record["fields"])
    assert tuning.measured
    for (B, T, D, _), s in itertools.product(SHAPES, BUDGETS):  # auto's own rule now picks the faster path
        for gran in ("sequence", "token"):
            assert tuning.prefers_dense(s, gran, B * T * D) == (not wins(B, T, D, s, "fwd"))


def test_a_cell_counts_as_a_win_only_when_every_pass_wins() -> None:
    def fwd_only(B: int, T: int, D: int, s: float, pas: str) -> bool:
        return pas == "fwd"

    cells = cell_wins(_records(fwd_only), "bfloat16")
    assert cells["sequence"] and not any(c["gathered_wins"] for c in cells["sequence"])
    record = tuning_record(_records(fwd_only))  # never faster: dense everywhere
    assert GatheredTuning(**record["fields"]).prefers_dense(0.125, "sequence", 8 * 2048 * 2048)


def test_the_fit_maximises_agreement_with_noisy_verdicts() -> None:
    cells = [{"skipped_work": w, "s": s, "gathered_wins": win}
             for w, s, win in [(1e5, 0.25, False), (1e6, 0.25, True), (2e6, 0.25, False), (1e7, 0.25, True),
                               (1e8, 0.25, True), (1e8, 0.5, True), (1e8, 1.0, False)]]
    f = fit(cells)
    assert f is not None

    def agree(m: float, d: float) -> int:  # written out: a cell agrees when the rule picks the faster path
        return sum(((c["skipped_work"] < m) or (c["s"] >= d)) != c["gathered_wins"] for c in cells)

    candidates = [0.0, *sorted({c["skipped_work"] for c in cells}), float("inf")]
    best = max(agree(m, d) for m in candidates for d in (0.25, 0.5, 1.0, float("inf")))
    assert f["agree"] == best == 6 and len(f["disagree"]) == 1
    assert f["min_skipped_work"] == 1e7 and f["dense_work"] == 1.0  # of the ties, the one with more dense calls


def test_no_cells_keep_the_current_values_and_the_other_dtype_is_ignored() -> None:
    record = tuning_record(_records(lambda *a: True, dtype="float32"))
    assert record["fits"] == {"sequence": None, "token": None} and record["fields"] == {"measured": True}
    assert any("no cell" in line for line in tuning_lines(record))
    assert fit([]) is None


@pytest.mark.parametrize("never", [True, False])
def test_infinite_thresholds_become_values_the_tuning_accepts(never: bool) -> None:
    fields = tuning_fields({"sequence": {"min_skipped_work": float("inf") if never else 0.0,
                                         "dense_work": float("inf")}, "token": None})
    tuning = GatheredTuning(**fields)
    assert tuning.dense_work_sequence == 1.0
    assert tuning.prefers_dense(0.125, "sequence", 8 * 2048 * 2048) is never


def test_cells_timed_off_cuda_are_not_proposed_as_measured_cuda_values() -> None:
    # a --device cpu dry run wrote measured: true and told the reader to copy CPU-fitted values into the CUDA tuning
    record = tuning_record(_records(lambda *a: True), on_cuda=False)
    assert record["fields"]["measured"] is False and not GatheredTuning(**record["fields"]).measured
    text = "\n".join(tuning_lines(record))
    assert "not for the CUDA tuning" in text and "copy them" not in text
    assert tuning_record(_records(lambda *a: True))["fields"]["measured"] is True  # a CUDA record stays as it was
