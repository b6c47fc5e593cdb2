"""The README's speed and studies tables, and the sentences issue 49's audit had reworded, against their records.

Each cell is recomputed here from the committed record it names (json and scipy, not condcomp's code):

- the README's "When is it faster?" rows for the demo (time ratios, arm / dense, at batch 64), SmolLM2 decoding
  (`condcomp bench decode`'s cells) and the GPU (the H200 run's paired gathered / dense forward ratios);
- the README's KV study line and the reworded split comparisons (now in docs/kv-frontier.md: retrieval counts, exact
  McNemar p) from `results/kv_facts_1024/records`;
- the 2x2's answer table (results/reproduction_target/README_2x2.md): its bootstrap column is the within-seed table
  the committed script prints, and the target's pooled example-level p is scipy's one-sample t.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_docs_numbers import _within_seed_script  # the one loader of results/reproduction_target/within_seed_2x2.py

sps = pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _row(text: str, starts: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(starts)]
    assert len(rows) == 1, f"one table row starting {starts!r}, found {len(rows)}"
    return rows[0]


def test_the_demo_row_is_time_over_dense_time() -> None:
    rows = json.loads((ROOT / "results" / "demo" / "run" / "metrics.json").read_text())["rows"]
    ratio = {arm: rows[arm]["latency_b64"] / rows["standard"]["latency_b64"] for arm in ("budgetformer", "moh")}
    row = _row(README, "| the demo's tiny model")
    assert f"BudgetFormer ({100 * rows['budgetformer']['k_frac']:.0f} % of heads) {ratio['budgetformer']:.2f}" in row
    assert f"MoH (50 % per token) {ratio['moh']:.2f}" in row
    assert ratio["budgetformer"] < 1 < ratio["moh"]  # in the column's units: BudgetFormer's time is below dense's


def test_the_decode_row_and_llm_serving_are_the_bench_decode_cells() -> None:
    records = json.loads((ROOT / "results" / "bench" / "decode" / "smollm2_cpu" / "metrics.json").read_text())
    cell = {r["variant"]: r for r in records["records"] if r["prompt"] == 2048 and r["batch"] == 8}
    row = _row(README, "| SmolLM2-135M decoding")
    keep = (cell["keep_0.67"], cell["keep_0.33"])
    assert f"{keep[0]['decode_ratio']:.2f} / {keep[1]['decode_ratio']:.2f} per token" in row
    assert f"(every group kept: {cell['full']['decode_ratio']:.2f})" in row
    assert f"the prefill is not faster ({keep[0]['prefill_ratio']:.2f} / {keep[1]['prefill_ratio']:.2f})" in row
    serving = " ".join((ROOT / "docs" / "llm-serving.md").read_text().split())
    assert f"less than it cuts the cache: {keep[1]['decode_ratio']:.2f}x dense at prompt 2048, batch 8" in serving


def test_the_gpu_row_is_the_h200_forward_range() -> None:
    records = json.loads((ROOT / "results" / "bench" / "gpu_check" / "h200" / "metrics.json").read_text())
    paired = [r["paired_to_dense"] for r in records if r["variant"] == "gathered" and r["pass"] == "fwd"]
    assert min(paired) > 1  # slower than dense at every budget and shape
    assert f"| {min(paired):.1f}-{max(paired):.1f} forward: **not faster**" in _row(README, "| a GPU")


def _kv(name: str) -> dict:
    return json.loads((ROOT / "results" / "kv_facts_1024" / "records" / f"{name}@1024.json").read_text())


def _mcnemar(a: str, b: str) -> float:
    ca, cb = _kv(a)["retrieval_correct"], _kv(b)["retrieval_correct"]
    only_a = sum(x and not y for x, y in zip(ca, cb))
    only_b = sum(y and not x for x, y in zip(ca, cb))
    return float(sps.binomtest(only_a, only_a + only_b, 0.5).pvalue)


def test_the_readme_kv_line_is_the_records() -> None:
    row = " ".join(_row(README, "| which KV option").split())
    dense, fp8, duo, press = (_kv(v) for v in ("dense", "quantized-fp8", "split-duo-1of3", "kvpress-streaming-0.50"))
    assert sum(fp8["retrieval_correct"]) == sum(dense["retrieval_correct"])
    assert _mcnemar("quantized-fp8", "dense") > 0.05  # "no difference detected"
    assert (f"as many keys as dense ({sum(dense['retrieval_correct'])} of 100 at 1024 tokens, no difference "
            f"detected) at {fp8['kv_frac']:.3f}x the bytes") in row
    assert duo["kv_frac"] > 0.5  # it holds slightly more than half: the split does not free "more than half"
    assert f"holds {duo['kv_frac']:.3f}x the bytes and finds {sum(duo['retrieval_correct'])}" in row
    budgets = _kv("headkv-0.50")
    assert f"(`headkv-0.50`) hold {budgets['kv_frac']:.3f}x and find {sum(budgets['retrieval_correct'])}" in row
    p, p2 = _mcnemar("split-duo-1of3", "kvpress-streaming-0.50"), _mcnemar("headkv-0.50", "kvpress-streaming-0.50")
    assert f"(the best, {sum(press['retrieval_correct'])}: p = {p:.2g} against the split, {p2:.2g} against the " \
           "budgets)" in row


def test_kv_md_reworded_sentences_are_the_records() -> None:
    """The split comparisons docs/kv.md moved to docs/kv-frontier.md (its targets: test_docs_kv_targets.py)."""
    text = " ".join((ROOT / "docs" / "kv-frontier.md").read_text().split())
    static, first, second = (sum(_kv(v)["retrieval_correct"]) for v in
                             ("split-static-1of3", "split-request-1of3", "split-request-1of3-seed1"))
    assert f"importance split ({static}, as plain streaming; p < 0.001)" in text
    assert _mcnemar("split-request-1of3", "split-static-1of3") < 0.001
    p_second = _mcnemar("split-request-1of3-seed1", "split-static-1of3")
    assert (f"The router's first training seed beats the static split ({first}, p < 0.001), its second does not "
            f"({second}, p = {p_second:.1f})") in text


def test_the_two_by_twos_answer_table_is_its_within_seed_table() -> None:
    """Every bootstrap the answer table gives is a pooled row of the table the script prints (the two-stage
    bootstrap), and the target's pooled example-level p is scipy's one-sample t on the committed examples."""
    import numpy as np

    script = _within_seed_script()
    bracket = re.compile(r"\[[+-]\d\.\d\d, [+-]\d\.\d\d\]")
    pooled = {b for line in script.table().splitlines()  # the pooled rows: "pooled (5)", or a table of 5 seeds
              if "pooled (" in line or re.match(r"\| (on|off) \| [^|]+ \| 5 \|", line) for b in bracket.findall(line)}
    text = (ROOT / "results" / "reproduction_target" / "README_2x2.md").read_text()
    answer = text[text.index("**The answer**"):text.index("<!-- summary for the study page: begin -->")]
    quoted = [b for line in answer.splitlines() if line.startswith("| ") for b in bracket.findall(line.split(" | ")[3])]
    assert len(quoted) >= 14
    assert not [q for q in quoted if q not in pooled], f"answer-table bootstraps the script does not print: {quoted}"
    data, _ = script.load()
    gap = {c: {s: data[c][s]["budgetformer"].astype(int) - data[c][s]["fixed_per_layer"].astype(int)
               for s in data[c]} for c in data}
    effect = np.concatenate([(gap["target_schedule"][s] + gap["target_default"][s] - gap["notarget_schedule"][s]
                              - gap["notarget_default"][s]) / 2 for s in sorted(gap["target_schedule"])])
    p = float(sps.ttest_1samp(effect, 0.0).pvalue)
    assert f"one-sample t over the pooled examples, ignoring the spread between seeds: p = {p:.3f}" in answer
    assert p < 0.05 and "| detected: the target raises the lead" in answer
