"""docs/kv.md's "Where the targets stand": each verdict, count, bound and test recomputed from the committed records
(json and scipy; the bound by Newcombe's method 10 written out in test_docs_numbers_frontier.py), and each target's
variant the one docs/kv-frontier.md's targets table names for it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_docs_numbers_frontier import AWARE, _lower_bound, _mcnemar, _rows

sps = pytest.importorskip("scipy.stats")
np = pytest.importorskip("numpy")

ROOT = Path(__file__).resolve().parent.parent
FACTS = ROOT / "results" / "kv_facts_1024" / "records"
SNLI = ROOT / "results" / "kv_snli_1024" / "records"


def _record(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}@1024.json").read_text())


def _section() -> str:
    text = (ROOT / "docs" / "kv.md").read_text()
    return " ".join(text[text.index("Where the targets stand"):text.index("Against the alternatives:")].split())


def _bullet(starts: str) -> str:
    found = [b for b in _section().split(" - **") if b.startswith(starts)]
    assert len(found) == 1, f"one target bullet starting {starts!r}"
    return found[0]


def _short(folder: Path, name: str, margin: float) -> tuple[list[bool], list[bool], float, float]:
    hits, dense = _record(folder, name)["retrieval_correct"], _record(folder, "dense")["retrieval_correct"]
    _, lower = _lower_bound(hits, dense)
    return hits, dense, lower * 100, -margin - lower * 100


def test_the_half_bytes_target() -> None:
    bullet = _bullet("Half the bytes, no quantization, within 5 points of dense, perplexity <= 1.03x")
    hits, dense, bound, short = _short(FACTS, "headkv-0.50", 5)
    assert short > 0 and bullet.startswith("Half the bytes, no quantization, within 5 points of dense, perplexity "
                                           "<= 1.03x**: missed.")
    assert f"`headkv-0.50` finds {sum(dense) - sum(hits)} keys fewer than dense, bound {bound:.1f} ({short:.1f} " \
           "points short)" in bullet
    ratio = _record(FACTS, "headkv-0.50")["ppl"] / _record(FACTS, "dense")["ppl"]
    assert ratio <= 1.03 and f"Its perplexity, {ratio:.3f}x, meets its part." in bullet
    split = _record(FACTS, "split-duo-1of3-w240")["retrieval_correct"]
    a, b, p = _mcnemar(hits, split)
    assert f"It finds {sum(hits) - sum(split)} more than the best split (`split-duo-1of3-w240`, {a} / {b} cases, " \
           f"p = {p:.2f}, no difference detected)" in bullet and p > 0.05


def test_the_quarter_and_eighth_targets() -> None:
    quarter = _bullet("A quarter, no quantization, within 10 points and above every press")
    hits, _, bound, short = _short(FACTS, "split-duo-1of6-w92", 10)
    press = _record(FACTS, "kvpress-streaming-0.25")["retrieval_correct"]
    _, _, p = _mcnemar(hits, press)
    assert short > 0 and f"missed. `split-duo-1of6-w92` finds {sum(hits)}, bound {bound:.1f} ({short:.1f} points " \
                         f"short), against the best press's {sum(press)} (p = {p:.2f})" in quarter
    screen = _record(ROOT / "results" / "kv_headkv_screen" / "agnostic" / "records", "headkv-0.25-full1of6")
    first = _record(FACTS, "split-duo-1of6-w92")["retrieval_correct"][:20]  # the screen's cases: the first 20
    assert sum(screen["retrieval_correct"]) == sum(first) and len(screen["retrieval_correct"]) == 20
    assert f"(`headkv-0.25-full1of6`) found {sum(first)} of 20 on a screen, as the split" in quarter
    eighth = _bullet("An eighth with quantization, within 10 points")
    _, _, bound, short = _short(FACTS, "split-duo-1of3+fp8", 10)
    assert short > 0 and f"missed by {short:.1f} points (`split-duo-1of3+fp8`, bound {bound:.1f})" in eighth


def test_the_question_aware_target() -> None:
    bullet = _bullet("Question-aware, a quarter, within 5 points")
    hits, dense, bound, short = _short(AWARE, "headkv-0.25-full1of6", 5)
    a, b, p = _mcnemar(hits, dense)
    pv = f"p = {p:.3f}" if p >= 0.001 else "p < 0.001"
    assert short > 0 and f"missed on {len(hits)} cases: `headkv-0.25-full1of6` finds {sum(hits)} of {len(hits)}, " \
                         f"dense {sum(dense)} ({a} / {b}, {pv}), bound {bound:.1f} ({short:.1f} points short)" in bullet
    plain = _record(AWARE, "headkv-0.25")["retrieval_correct"]
    assert f"`headkv-0.25`, without the sixth kept full, found {sum(plain)}" in bullet


def test_the_question_aware_records_pair_with_the_study() -> None:
    """Dense answers the same cases with the question seen (its records pair with the study's), and pairs.md is what
    the folder's script writes from the records."""
    import importlib.util

    assert _record(AWARE, "dense")["retrieval_correct"] == _record(FACTS, "dense")["retrieval_correct"]
    assert _record(AWARE, "dense")["settings"]["question_aware"] is True
    spec = importlib.util.spec_from_file_location("aware_pairs", AWARE.parent / "pairs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.pairs_table(AWARE, module.PAIRS) + "\n\nAgainst the study's records on the same cases " \
        "(`../kv_facts_1024`, the question after the context):\n\n" + module.across()
    assert table in (AWARE.parent / "pairs.md").read_text()
    aware, split = (_record(f, n)["retrieval_correct"] for f, n in ((AWARE, "headkv-0.25"),
                                                                   (FACTS, "split-duo-1of6-w92")))
    frontier = " ".join((ROOT / "docs" / "kv-frontier.md").read_text().split())
    assert f"the per-group budgets find {sum(aware)} keys on the 100 cases" in frontier
    assert f"dense {sum(_record(AWARE, 'dense')['retrieval_correct'])}, the same cases as without the question), " \
           f"as many as the sixth-in-full split that does not see it ({sum(split)})" in frontier
    assert _mcnemar(aware, split)[2] > 0.05  # "as many": no difference detected
    sharper = _record(AWARE, "headkv-0.25-full1of6")["retrieval_correct"]
    a, b, p = _mcnemar(sharper, aware)
    gap = sum(_record(AWARE, "dense")["retrieval_correct"]) - sum(sharper)
    assert p < 0.001 and f"With the highest-gated sixth kept full first they find {sum(sharper)} ({a} / {b} cases " \
                         f"against {sum(aware)}, p < 0.001), {gap} short of dense" in frontier


def test_the_second_domain_target() -> None:
    """The perplexity ratio over the same tokens and its percentile bootstrap over tokens (scipy, 2000 resamples,
    seed 0: the settings of the record's summary)."""
    bullet = _bullet("Perplexity on a second domain <= 1.05x")
    split, dense = _record(SNLI, "split-duo-1of3"), _record(SNLI, "dense")
    x = np.array([v for w in split["token_nll"] for v in w]) - np.array([v for w in dense["token_nll"] for v in w])
    ci = sps.bootstrap((x,), lambda d, axis: np.exp(d.mean(axis=axis)), n_resamples=2000, method="percentile",
                       rng=np.random.default_rng(0)).confidence_interval
    ratio = float(np.exp(x.mean()))
    assert ratio <= 1.05 and bullet.startswith("Perplexity on a second domain <= 1.05x**: met.")
    assert f"`split-duo-1of3` on SNLI captions: {ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}]" in bullet


def test_each_target_names_the_frontier_tables_variant() -> None:
    table = {re.search(r"<= (\d\.\d+)x", c[0])[1] + ("aware" if "question-aware" in c[0] else ""):  # type: ignore[index]
             re.findall(r"`([^`]+)`", c[1])[-1] for c in _rows()}
    for starts, key in (("Half the bytes", "0.5"), ("A quarter, no", "0.25"), ("An eighth", "0.13"),
                        ("Question-aware", "0.25aware")):
        assert f"`{table[key]}`" in _bullet(starts), (starts, table[key])
