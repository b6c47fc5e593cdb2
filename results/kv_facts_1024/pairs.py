"""Paired retrieval comparisons the KV pages quote, from this folder's records.

Every variant answered the same 100 cases in the same order (`retrieval_correct`), so two variants are compared
with the exact McNemar test (scipy: a two-sided binomial test on the cases only one of them found) and the
one-sided 95 % lower bound of the difference in keys found (Newcombe's paired interval):
`condcomp.bench.kv_pairs`. The docs-number tests recompute what the pages quote with scipy alone.

    python results/kv_facts_1024/pairs.py            # prints the table
    python results/kv_facts_1024/pairs.py --write    # and writes pairs.md beside this script
"""

from __future__ import annotations

import sys
from pathlib import Path

from condcomp.bench.kv_pairs import pairs_table

HERE = Path(__file__).resolve().parent
PAIRS = [  # (a, b, why the pair is asked)
    ("split-duo-1of3", "kvpress-streaming-0.50", "the DuoAttention split against the best press that frees half"),
    ("split-duo-1of3", "kvpress-duo-gates-1of3", "the same gates: condcomp frees the streamed groups, kvpress masks"),
    ("split-duo-1of3", "split-duo-1of3-seed1", "the DuoAttention gates' two training seeds"),
    ("split-duo-1of3", "split-request-1of3", "DuoAttention split against the per-request split (seed 0)"),
    ("split-duo-1of3", "split-static-1of3", "DuoAttention split against the static importance split"),
    ("split-request-1of3", "split-static-1of3", "per-request split (seed 0) against the static split"),
    ("split-request-1of3-seed1", "split-static-1of3", "per-request split (seed 1) against the static split"),
    ("split-request-1of3", "split-request-1of3-seed1", "the per-request split's two training seeds"),
    ("split-request-1of3", "kvpress-streaming-0.50", "per-request split (seed 0) against the best freeing press"),
    ("split-duo-1of6-w92", "kvpress-streaming-0.25", "a quarter of the bytes: the split against the best press"),
    ("split-duo-1of3+fp8", "quantized-hqq4", "about an eighth of the bytes against the 4-bit cache (0.16x)"),
    ("split-duo-1of3+fp8", "quantized-fp8", "the split inside fp8 against the fp8 cache alone"),
    ("split-duo-1of6-w396", "split-duo-1of3", "at half the bytes: a sixth in full (windows 396) or a third (252)"),
    ("split-duo-1of6-w396", "kvpress-streaming-0.50", "the sixth-in-full split against the best press at 0.5x"),
    ("split-duo-1of3-w240", "split-duo-1of6-w396", "under half the bytes: a third in full (windows 240) or a sixth"),
    ("split-duo-5of12-w124", "split-duo-1of3-w240", "under half the bytes: 5/12 in full (windows 124) or a third"),
    ("split-duo-1of6-w396+fp8", "split-duo-1of3+fp8", "inside fp8 (0.126x): the sixth-in-full split against the third"),
    ("split-duo-1of3-w240+fp8", "split-duo-1of3+fp8", "inside fp8: the third in full with windows 240 or 252"),
    ("split-duo-1of3-w240+fp8", "split-duo-1of6-w396+fp8", "inside fp8: a third in full (windows 240) or a sixth"),
    ("split-duo-1of6-w396+fp8", "quantized-hqq4", "the sixth-in-full split in fp8 against the 4-bit cache (0.156x)"),
    ("snapkv-0.50", "kvpress-snapkv-0.50", "condcomp's SnapKV policy against kvpress's SnapKV press"),
    ("adakv-0.50", "kvpress-adakv-snapkv-0.50", "condcomp's AdaKV policy (frees) against kvpress's (masks)"),
    ("headkv-0.50", "dense", "half the bytes: the per-group budgets against the dense cache"),
    ("headkv-0.50", "split-duo-1of3-w240", "at most half the bytes: per-group budgets or the best split"),
    ("headkv-0.50", "split-duo-1of3", "the same gates: per-group budgets or a third in full, windows 252"),
    ("headkv-0.50", "kvpress-streaming-0.50", "the per-group budgets against the best press that frees half"),
]


def main() -> None:
    table = pairs_table(HERE / "records", PAIRS)
    print(table)
    if "--write" in sys.argv:
        (HERE / "pairs.md").write_text("# Paired retrieval comparisons (exact McNemar, 100 cases at 1024 tokens)\n\n"
                                       "Made by `python results/kv_facts_1024/pairs.py --write` from `records/`; "
                                       "bytes (x dense) in brackets; the bound is Newcombe's paired interval "
                                       "(`condcomp.bench.kv_pairs`).\n\n" + table + "\n")


if __name__ == "__main__":
    main()
