"""docs/kv-calibration.md's numbers come from the committed records, recomputed with scipy (not condcomp's code):
the two screens' table cells (``results/kv/duo_screen/screen.json``, ``results/kv/request_screen*.json``), the
counts and percentages its prose derives from them, and the p-values and intervals of its retrieval sentences
(``results/kv`` and ``results/kv_passkey50``)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

sps = pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parent.parent


def _kv_records(folder: str) -> dict[tuple[str, int], dict]:
    m = json.loads((ROOT / "results" / folder / "metrics.json").read_text())
    return {(r["variant"], int(r["prompt_len"])): r for r in m["records"]}


CALIBRATION_ROWS = {  # docs/kv-calibration.md's screen rows -> the split names their records use
    "streaming, every group": ["streaming (none full)"],
    "importance, 1 of 3 per layer": ["importance per layer, 1 of 3"],
    "importance, top third over the model": ["importance global 0.333"],
    "DuoAttention gates, seed 0 (": ["duo_gates global 0.333"],
    "DuoAttention gates, seed 1": ["duo_gates_seed1 global 0.333"],
    "DuoAttention gates, seed 0 /": ["duo_gates global 0.333", "duo_gates_seed1 global 0.333"],
    "per-request routers, seed 0": ["request_router_seed0 per request"],
    "per-request routers, seed 1": ["request_router_seed1 per request"],
    "each router's most frequent": ["majority_seed0 global 0.333", "majority_seed1 global 0.333"],
}


def test_the_kv_calibration_screens_and_tests_are_their_records() -> None:
    """docs/kv-calibration.md: every screen-table cell (hidden-state distance, perplexity x dense) equals its record
    at the quoted precision, and every p-value and interval its retrieval sentences quote is scipy's on the
    committed counts (exact McNemar where one arm found no key, so every discordant case is known; Fisher and
    Newcombe's interval where the record keeps no per-case results)."""
    text = (ROOT / "docs" / "kv-calibration.md").read_text()
    kv = ROOT / "results" / "kv"
    results = {**json.loads((kv / "duo_screen" / "screen.json").read_text())["results"]}
    request = {**json.loads((kv / "request_screen.json").read_text())["results"],
               **json.loads((kv / "request_screen" / "majority_screen.json").read_text())["results"]}
    first, second = text.split("## A per-request split")
    checked = 0
    for section, records in ((first, results), (second, request)):
        for line in section.splitlines():
            split = next((k for k in CALIBRATION_ROWS if line.startswith(f"| {k}")), None)
            if split is None:
                continue
            cells = [c.replace("*", "").strip() for c in line.strip("|").split(" | ")]
            for column, key in ((1, "hidden_mse"), (2, "ppl_ratio")):
                quoted = cells[column].split(" / ")
                assert len(quoted) == len(CALIBRATION_ROWS[split]), line
                for q, name in zip(quoted, CALIBRATION_ROWS[split]):
                    digits = len(q.split(".")[1])
                    assert f"{records[name][key]:.{digits}f}" == q, f"{line}: {key} of {name} is {records[name][key]}"
                    checked += 1
    assert checked == 26  # 5 rows of the first screen, 6 rows (8 values) of the second, two columns each

    def newcombe(x1: int, x2: int, n: int) -> tuple[float, float]:
        (l1, u1), (l2, u2) = (sps.binomtest(x, n).proportion_ci(method="wilson") for x in (x1, x2))
        d = (x1 - x2) / n
        return d - math.hypot(x1 / n - l1, u2 - x2 / n), d + math.hypot(u1 - x1 / n, x2 / n - l2)

    bench = _kv_records("kv")
    found = {v: round(bench[(v, 2048)]["passkey_acc"] * bench[(v, 2048)]["passkey_n"])
             for v in ("dense", "split-duo-1of3", "split-static-1of3", "split-request-1of3")}
    assert found == {"dense": 4, "split-duo-1of3": 3, "split-static-1of3": 0, "split-request-1of3": 2}
    fifty = _kv_records("kv_passkey50")
    keys50 = {v: round(fifty[(v, 2048)]["passkey_acc"] * 50) for v in ("dense", "split-duo-1of3", "split-static-1of3")}
    assert keys50 == {"dense": 13, "split-duo-1of3": 11, "split-static-1of3": 6}
    depths = [fifty[(v, 2048)]["passkey_by_depth"] for v in ("split-duo-1of3", "split-static-1of3")]
    fewest_discordant = sum(max(0, round(10 * (depths[0][d] - depths[1][d]))) for d in depths[0])
    assert fewest_discordant == 5 and all(depths[1][d] <= depths[0][d] for d in depths[0])
    lo, hi = newcombe(11, 6, 50)
    lo10, hi10 = newcombe(2, 3, 10)
    quoted = {
        "exact McNemar p = 0.25": sps.binomtest(3, 3).pvalue,  # the static split found none of 10
        "Fisher p = 0.29": sps.fisher_exact([[11, 39], [6, 44]]).pvalue,
        "McNemar p = 0.0625": sps.binomtest(fewest_discordant, fewest_discordant).pvalue,
        f"[{lo:+.2f}, {hi:+.2f}] (Newcombe)": 0.0,
        "exact McNemar p = 0.5": sps.binomtest(2, 2).pvalue,
        "Fisher p = 1.0": sps.fisher_exact([[2, 8], [3, 7]]).pvalue,
        f"[{lo10:+.2f}, {hi10:+.2f}], Newcombe": 0.0,
    }
    flat = " ".join(text.split())
    for phrase, p in quoted.items():
        assert phrase in flat, f"docs/kv-calibration.md no longer says {phrase!r}"
        number = re.search(r"p = ([0-9.]+)", phrase)
        if number:
            digits = len(number.group(1).split(".")[1])
            assert f"{p:.{digits}f}" == number.group(1), f"{phrase}: scipy gives {p}"


def test_the_kv_calibration_prose_numbers_are_their_records() -> None:
    """docs/kv-calibration.md's counts and relative distances, recomputed from the screens' records: the gates'
    overlaps, the routers' per-request choices, and the percentages between the screens' hidden-state distances."""
    flat = " ".join((ROOT / "docs" / "kv-calibration.md").read_text().split())
    kv = ROOT / "results" / "kv"
    duo = json.loads((kv / "duo_screen" / "screen.json").read_text())
    req = json.loads((kv / "request_screen.json").read_text())["results"]
    majority = json.loads((kv / "request_screen" / "majority_screen.json").read_text())["results"]

    def kept(split: list[list[int]]) -> set[tuple[int, int]]:
        return {(layer, g) for layer, groups in enumerate(split) for g in groups}

    seed0, seed1, static = (kept(duo["splits"][k]) for k in ("duo_gates global 0.333", "duo_gates_seed1 global 0.333",
                                                              "importance per layer, 1 of 3"))
    full_layers = [i for i, g in enumerate(duo["splits"]["duo_gates global 0.333"]) if len(g) == 3]
    empty = sum(not g for g in duo["splits"]["duo_gates global 0.333"])
    mse = {k: v["hidden_mse"] for k, v in duo["results"].items()}
    ratios = [mse[d] / mse[i] for d in ("duo_gates global 0.333", "duo_gates_seed1 global 0.333")
              for i in ("importance per layer, 1 of 3", "importance global 0.333")]
    choices = [req[f"request_router_seed{s} per request"]["choices"] for s in (0, 1)]  # (rows, layers, [group])
    most = [[max(range(3), key=lambda g, c=c, layer=layer: (sum(r[layer][0] == g for r in c), -g))
             for layer in range(30)] for c in choices]
    r0, r1 = (req[f"request_router_seed{s} per request"]["hidden_mse"] for s in (0, 1))
    start = req["importance per layer, 1 of 3"]["hidden_mse"]
    gates = [req["duo_gates global 0.333"]["hidden_mse"], req["duo_gates_seed1 global 0.333"]["hidden_mse"]]
    m0, m1 = (majority[f"majority_seed{s} global 0.333"]["hidden_mse"] for s in (0, 1))

    def pct(values: list[float]) -> str:
        return f"{round(100 * min(values))}-{round(100 * max(values))}%"

    expected = [
        f"keep {len(seed0 & seed1)} of the same 30 groups",
        f"they share {len(seed0 & static)} and {len(seed1 & static)} of their 30",
        f"layers {full_layers[0]}, {full_layers[1]} and {full_layers[2]} and none in {empty} layers",
        f"is {min(ratios):.2f}-{max(ratios):.2f} of the importance splits'",
        f"in {100 * req['request_router_seed0 per request']['differs_from_static']:.1f}% (seed 0) and "
        f"{100 * req['request_router_seed1 per request']['differs_from_static']:.1f}% (seed 1)",
        f"get {len({json.dumps(c) for c in choices[0]})} (seed 0) and {len({json.dumps(c) for c in choices[1]})} "
        "(seed 1) different splits",
        f"agree in {sum(a == b for a, b in zip(*most))} of 30 layers",
        f"reads {pct([1 - r0 / start, 1 - r1 / start])} below the importance split",
        f"differ from each other by {round(100 * (r1 - r0) / r1)}%",
        f"reads {pct([m0 / r0 - 1, m1 / r1 - 1])} above the per-request routing",
        f"read {pct([1 - g / r for g in gates for r in (r0, r1)])} below both seeds",
    ]
    missing = [e for e in expected if e not in flat]
    assert not missing, f"docs/kv-calibration.md does not say what the records give: {missing}"
