"""Paired retrieval comparisons of the question-aware records (100 cases at 1024 tokens), and against the study's
records on the same cases without the question seen (`results/kv_facts_1024`).

Both folders hold the same 100 cases in the same order: the same facts, depths and haystacks, the same text; only
where the cache is cut differs (checked below on the cases each record keeps as samples: the same keys at the same
depths). The tables: `condcomp.bench.kv_pairs` (exact McNemar, one-sided 95 % bound of a - b, Newcombe's paired
interval); the docs-number tests recompute what the pages quote with scipy alone.

    python results/kv_facts_aware_1024/pairs.py            # prints the table
    python results/kv_facts_aware_1024/pairs.py --write    # and writes pairs.md beside this script
"""

from __future__ import annotations

import sys
from pathlib import Path

from condcomp.bench.kv_pairs import compare, load_record, pairs_table

HERE = Path(__file__).resolve().parent
AGNOSTIC = HERE.parent / "kv_facts_1024" / "records"
PAIRS = [  # (a, b, why the pair is asked), both question-aware
    ("headkv-0.25", "dense", "a quarter of the bytes, the question seen: the per-group budgets against dense"),
    ("headkv-0.25-full1of6", "dense", "the same budget with the highest-gated sixth of the pairs kept full first"),
    ("headkv-0.25-full1of6", "headkv-0.25", "what keeping the sixth full first changes"),
]
ACROSS = [  # (question-aware record, record of the study: the question after the context), on the same cases
    ("dense", "dense"),
    ("headkv-0.25", "split-duo-1of6-w92"),  # the split's kept tokens do not depend on the question
    ("headkv-0.25", "kvpress-streaming-0.25"),  # nor do StreamingLLM's
    ("headkv-0.25-full1of6", "split-duo-1of6-w92"),
    ("headkv-0.25-full1of6", "kvpress-streaming-0.25"),
]


def across() -> str:
    """Aware records against the study's on the same cases."""
    lines = ["| aware | after the context | aware found | after found | only aware / only after | McNemar p |",
             "|---|---|---|---|---|---|"]
    for name, other in ACROSS:
        aware, agnostic = load_record(HERE / "records", name), load_record(AGNOSTIC, other)
        if aware is None or agnostic is None:
            raise SystemExit(f"{name} / {other}: a record is missing")
        if aware["settings"]["passkey_cases"] != agnostic["settings"]["passkey_cases"]:
            raise SystemExit(f"{name} / {other}: the two modes measured different case counts")
        if [(x["key"], x["depth"]) for x in aware["samples"]] != [(x["key"], x["depth"]) for x in agnostic["samples"]]:
            raise SystemExit(f"{name} / {other}: the sampled cases differ (keys or depths): not the same cases")
        c = compare(aware["retrieval_correct"], agnostic["retrieval_correct"])
        lines.append(f"| {name} ({aware['kv_frac']:.3f}x) | {other} ({agnostic['kv_frac']:.3f}x) | "
                     f"{sum(aware['retrieval_correct'])} | {sum(agnostic['retrieval_correct'])} | "
                     f"{c['a_only']} / {c['b_only']} | {c['p']:.3g} |")
    return "\n".join(lines)


def main() -> None:
    text = pairs_table(HERE / "records", PAIRS) + "\n\nAgainst the study's records on the same cases " \
        "(`../kv_facts_1024`, the question after the context):\n\n" + across()
    print(text)
    if "--write" in sys.argv:
        (HERE / "pairs.md").write_text("# Paired retrieval comparisons, question-aware (100 cases at 1024 tokens)\n\n"
                                       "Made by `python results/kv_facts_aware_1024/pairs.py --write` from "
                                       "`records/`; bytes (x dense) in brackets.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
