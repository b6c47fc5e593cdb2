"""Paired retrieval comparisons of the gates trained at 1024 tokens, from this folder's records (scipy, not
condcomp's code).

Every variant of one task answered the same cases in the same order (`retrieval_correct`), so two variants are
compared with the exact McNemar test: a two-sided binomial test on the cases only one of them found.

    python results/kv_gates_1024/pairs.py            # prints the table
    python results/kv_gates_1024/pairs.py --write    # and writes pairs.md beside this script
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scipy.stats import binomtest

HERE = Path(__file__).resolve().parent
PAIRS = [  # (task folder, a, b, why the pair is asked)
    ("facts", "split-duo1024-1of3", "split-duo-1of3", "the mixture gates at 1024 against the pass-key gates at 768"),
    ("facts", "split-duo1024-1of3", "split-duo-1of3-seed1", "the mixture gates against the pass-key gates' seed 1"),
    ("facts", "split-duo1024-1of3-seed1", "split-duo-1of3-seed1", "the same, training seed 1 of each"),
    ("facts", "split-duo1024-1of3", "split-duo1024-1of3-seed1", "the mixture gates' two training seeds"),
    ("facts", "split-duo1024-1of3", "dense", "the mixture gates' split against the dense cache"),
    ("facts", "split-duo1024-1of6-w92", "split-duo-1of6-w92", "a quarter of the bytes: mixture against pass-key gates"),
    ("quotes", "split-duo1024-1of3", "split-duo-1of3", "the quotes task: mixture against pass-key gates"),
    ("quotes", "split-duo1024-1of3-seed1", "split-duo-1of3", "the quotes task: mixture seed 1 against pass-key gates"),
    ("quotes", "split-duo1024-1of3", "dense", "the quotes task: the mixture gates' split against dense"),
]


def load(task: str, name: str) -> dict | None:
    path = HERE / task / "records" / f"{name}@1024.json"
    return json.loads(path.read_text()) if path.is_file() else None


def pair(ca: list[bool], cb: list[bool]) -> tuple[int, int, float]:
    """``(only a, only b, exact McNemar p)``."""
    only_a = sum(x and not y for x, y in zip(ca, cb))
    only_b = sum(y and not x for x, y in zip(ca, cb))
    return only_a, only_b, binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0


def main() -> None:
    lines = ["| task | a | b | a found | b found | only a / only b | McNemar p | question |",
             "|---|---|---|---|---|---|---|---|"]
    for task, a, b, why in PAIRS:
        ra, rb = load(task, a), load(task, b)
        if ra is None or rb is None:
            continue
        ca, cb = ra["retrieval_correct"], rb["retrieval_correct"]
        if len(ca) != len(cb):
            raise SystemExit(f"{a} and {b} answered different case lists ({len(ca)} and {len(cb)})")
        only_a, only_b, p = pair(ca, cb)
        lines.append(f"| {task} ({len(ca)}) | {a} ({ra['kv_frac']:.3f}x) | {b} ({rb['kv_frac']:.3f}x) | {sum(ca)} | "
                     f"{sum(cb)} | {only_a} / {only_b} | {p:.3g} | {why} |")
    table = "\n".join(lines)
    print(table)
    if "--write" in sys.argv:
        (HERE / "pairs.md").write_text("# Paired retrieval comparisons (exact McNemar, 1024 tokens)\n\n"
                                       "Made by `python results/kv_gates_1024/pairs.py --write` from `facts/records/` "
                                       "and `quotes/records/`; bytes (x dense) in brackets, cases in brackets after "
                                       "the task.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
