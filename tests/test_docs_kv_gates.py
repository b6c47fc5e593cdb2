"""docs/kv-frontier.md's section on the mixture gates, recomputed from the committed records with scipy (not
condcomp's code): the screen table's cells (``results/kv/duo_mix_screen/screen.json``), the groups the gate files
share, and the counts and exact McNemar p-values of ``results/kv_gates_1024``'s facts and quotes records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

sps = pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Gates trained at the length they serve, on a mixture"
ROWS = {  # the table's first cell -> the split name in the screens' records
    "streaming (every group windowed)": "streaming (none full)",
    "static importance, 1 of 3 per layer": "importance per layer, 1 of 3",
    "pass-key gates at 768 tokens, seed 0": "duo_gates global 0.333",
    "pass-key gates at 768 tokens, seed 1": "duo_gates_seed1 global 0.333",
    "mixture gates at 1024 tokens, seed 0": "duo_gates_mix1024_seed0 global 0.333",
    "mixture gates at 1024 tokens, seed 1": "duo_gates_mix1024_seed1 global 0.333",
}


def _section() -> str:
    return (ROOT / "docs" / "kv-frontier.md").read_text().split(SECTION)[1]


def _correct(task: str, variant: str) -> list[bool]:
    path = ROOT / "results" / "kv_gates_1024" / task / "records" / f"{variant}@1024.json"
    return [bool(x) for x in json.loads(path.read_text())["retrieval_correct"]]


def test_the_mixture_screen_table_is_its_record() -> None:
    folder = ROOT / "results" / "kv" / "duo_mix_screen"
    first, second = (json.loads((folder / f).read_text()) for f in ("screen.json", "screen_seed1.json"))
    assert (first["rows"], first["seq_len"], first["seed"]) == (second["rows"], second["seq_len"], second["seed"])
    same = "streaming (none full)"  # the same rows: the split both runs screened reads the same
    assert first["results"][same] == second["results"][same]
    results = {**first["results"], **second["results"]}
    checked = 0
    for line in _section().splitlines():
        label = next((k for k in ROWS if line.startswith(f"| {k}")), None)
        if label is None:
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        for column, key in ((1, "hidden_mse"), (2, "ppl_ratio")):
            digits = len(cells[column].split(".")[1])
            assert f"{results[ROWS[label]][key]:.{digits}f}" == cells[column], f"{line}: {key}"
            checked += 1
    assert checked == 2 * len(ROWS)
    old0, old1, new0, new1 = (results[ROWS[k]]["hidden_mse"] for k in list(ROWS)[2:])
    assert min(old0, old1) < new0 < max(old0, old1) and new1 < min(old0, old1)  # "between", "seed 1 reads lower"
    assert all(r["answer_acc"] == 0 for r in results.values())  # "no split answered any ... (dense none either)"


def test_the_mixture_bench_numbers_are_their_records() -> None:
    from condcomp.experiments.llm.duo_gates import load_gates, split_from_scores

    def kept(path: str) -> set[tuple[int, int]]:
        split = split_from_scores(load_gates(ROOT / path, 30, 3)["scores"], 1 / 3)
        return {(layer, g) for layer, gs in enumerate(split) for g in gs}

    shared = len(kept("results/kv/duo_gates_mix1024_seed0.json") & kept("results/kv/duo_gates.json"))
    seeds = len(kept("results/kv/duo_gates_mix1024_seed0.json") & kept("results/kv/duo_gates_mix1024_seed1.json"))
    new, old0, old1, dense = (_correct("facts", v) for v in ("split-duo1024-1of3", "split-duo-1of3",
                                                              "split-duo-1of3-seed1", "dense"))

    def mcnemar(a: list[bool], b: list[bool]) -> tuple[int, int, float]:
        only_a, only_b = sum(x and not y for x, y in zip(a, b)), sum(y and not x for x, y in zip(a, b))
        return only_a, only_b, sps.binomtest(only_a, only_a + only_b).pvalue if only_a + only_b else 1.0

    a0, b0, p0 = mcnemar(new, old0)
    a1, b1, p1 = mcnemar(new, old1)
    q_new, q_old, q_dense = (_correct("quotes", v) for v in ("split-duo1024-1of3", "split-duo-1of3", "dense"))
    expected = [
        f"keep {shared} of the same 30 groups in full; the mixture's two seeds share {seeds}",
        f"finds {sum(new)} keys, the old gates' {sum(old0)} (seed 0) and {sum(old1)} (seed 1), dense {sum(dense)}",
        f"{a0} cases found only by the new split, {b0} only by the old, exact McNemar p = {p0:.2f}",
        f"{a1} against {b1}, p = {p1:.4f}",
        f"both splits find {sum(q_new)}, the same cases (dense {sum(q_dense)})",
    ]
    flat = " ".join(_section().split())
    missing = [e for e in expected if e not in flat]
    assert not missing, f"docs/kv-calibration.md does not say what the records give: {missing}"
    assert q_new == q_old and len(new) == 100 and len(q_new) == 20
