"""The screen's table from its records (scipy's exact binomial test, not condcomp's code).

Question-agnostic: ``agnostic/records`` (dense and the headkv variants) beside the first 20 cases of
``results/kv_facts_1024`` (dense and the DuoAttention splits, measured on the same cases: dense's 20 answers here
must equal its first 20 there, checked). Question-aware: ``aware/records``, every variant measured here.

    python results/kv_headkv_screen/table.py            # prints the table
    python results/kv_headkv_screen/table.py --write    # and writes table.md beside this script
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scipy.stats import binomtest

HERE = Path(__file__).resolve().parent
STUDY = HERE.parent / "kv_facts_1024" / "records"
VARIANTS = ("dense", "split-duo-1of3", "split-duo-1of6-w92", "headkv-0.50", "headkv-0.25", "headkv-window-0.50",
            "headkv-window-0.25", "headkv-0.25-full1of6")
N = 20


def record(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}@1024.json"
    return json.loads(path.read_text()) if path.is_file() else None


def mode(label: str, found: dict[str, tuple[list[bool], float, str]]) -> list[str]:
    dense = found["dense"][0]
    rows = []
    for name in VARIANTS:
        if name not in found:
            continue
        hits, frac, source = found[name]
        a_only = sum(x and not d for x, d in zip(hits, dense))
        d_only = sum(d and not x for x, d in zip(hits, dense))
        p = binomtest(a_only, a_only + d_only, 0.5).pvalue if a_only + d_only else 1.0
        vs = "-" if name == "dense" else f"{a_only} / {d_only}, p {p:.3f}"
        rows.append(f"| {label} | `{name}` | {frac:.3f} | {sum(hits)} of {len(hits)} | {vs} | {source} |")
    return rows


def main() -> str:
    agnostic: dict[str, tuple[list[bool], float, str]] = {}
    for name in VARIANTS:
        here = record(HERE / "agnostic" / "records", name)
        if here is not None:
            agnostic[name] = (here["retrieval_correct"], here["kv_frac"], "`agnostic/records`")
    study = {n: record(STUDY, n) for n in VARIANTS}
    if "dense" in agnostic and study["dense"] is not None:
        first = study["dense"]["retrieval_correct"][:N]
        assert agnostic["dense"][0] == first, "dense's answers differ from the study's first 20: not the same cases"
        for name in ("split-duo-1of3", "split-duo-1of6-w92"):
            r = study[name]
            if r is not None:
                agnostic[name] = (r["retrieval_correct"][:N], r["kv_frac"], "`kv_facts_1024`, its first 20")
    aware = {}
    for name in VARIANTS:
        r = record(HERE / "aware" / "records", name)
        if r is not None:
            aware[name] = (r["retrieval_correct"], r["kv_frac"], "`aware/records`")
    lines = ["| question | variant | bytes x dense | found | only it / only dense, exact McNemar | record |",
             "|---|---|---|---|---|---|"]
    if "dense" in agnostic:
        lines += mode("after the context", agnostic)
    if "dense" in aware:
        lines += mode("aware", aware)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = main()
    print(text, end="")
    if "--write" in sys.argv[1:]:
        (HERE / "table.md").write_text(text)
