"""Paired retrieval comparisons between the records of one ``condcomp bench kv`` folder, as a markdown table (the
``pairs.md`` of a results folder). Needs scipy (``pip install 'condcomp[report]'``).

Every variant of one run answers the same cases in the same order (``retrieval_correct``), so two variants are
compared on their pairs: the exact McNemar test (a two-sided binomial test on the cases only one of them found,
scipy's ``binomtest``) and the one-sided lower bound of ``acc(a) - acc(b)`` at level ``1 - alpha`` (Newcombe's
paired interval, :func:`condcomp.bench.kv_stats.paired_difference_interval`): against ``b = dense`` it is the
non-inferiority bound of the summary's "Paired statistics", where ``a`` is non-inferior within a margin ``m`` when
the bound is above ``-m``.

>>> print(pairs_table(Path("results/kv_facts_1024/records"), [("split-duo-1of3", "dense", "why")]))  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from condcomp.bench.kv_stats import KVStats, paired_difference_interval

__all__ = ["compare", "header", "load_record", "pairs_table"]

DEFAULT = KVStats()  # 95 % one-sided bound



def header(cfg: KVStats = DEFAULT) -> str:
    """The table's two header lines (the bound's level from ``cfg.alpha``)."""
    return (f"| a | b | a found | b found | only a / only b | McNemar p | a - b, one-sided {100 * (1 - cfg.alpha):g} % "
            "bound | question |\n|---|---|---|---|---|---|---|---|")


def load_record(records: Path, name: str, prompt: int = 1024) -> dict[str, Any] | None:
    """``records/<name>@<prompt>.json`` as written by ``condcomp bench kv``, or None when it was not measured."""
    path = Path(records) / f"{name}@{prompt}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def compare(a: Sequence[bool], b: Sequence[bool], cfg: KVStats = DEFAULT) -> dict[str, Any]:
    """``{"a_only", "b_only", "p", "diff", "lower"}`` for two per-case results over the same cases: the exact McNemar
    p (two-sided) and ``acc(a) - acc(b)`` with its one-sided ``1 - cfg.alpha`` lower bound (Newcombe, method 10)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a paired comparison needs results over the same cases (>= 1), got {len(a)} and {len(b)}: "
                         "were the two records measured with different --cases?")
    from scipy.stats import binomtest

    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    p = float(binomtest(a_only, a_only + b_only, 0.5).pvalue) if a_only + b_only else 1.0
    diff, lower, _ = paired_difference_interval(a, b, 1 - 2 * cfg.alpha)
    return {"a_only": a_only, "b_only": b_only, "p": p, "diff": diff, "lower": lower}


def pairs_table(records: Path, pairs: Sequence[tuple[str, str, str]], prompt: int = 1024,
                cfg: KVStats = DEFAULT) -> str:
    """The markdown table of ``pairs`` (``(a, b, why the pair is asked)``) from the records in ``records``; bytes
    (x dense) in brackets after each name. A pair whose record is missing is listed under the table as not
    measured, not dropped silently."""
    lines, missing = [header(cfg)], []
    for a, b, why in pairs:
        ra, rb = load_record(records, a, prompt), load_record(records, b, prompt)
        if ra is None or rb is None:
            missing.append(f"{a} / {b}")
            continue
        ca, cb = ra["retrieval_correct"], rb["retrieval_correct"]
        if len(ca) != len(cb):
            raise ValueError(f"{a} and {b} answered different case lists ({len(ca)} and {len(cb)} cases): measure "
                             "both with the same --cases and settings")
        c = compare(ca, cb, cfg)
        lines.append(f"| {a} ({ra['kv_frac']:.3f}x) | {b} ({rb['kv_frac']:.3f}x) | {sum(ca)} | {sum(cb)} | "
                     f"{c['a_only']} / {c['b_only']} | {c['p']:.3g} | {c['diff'] * 100:+.1f} (>= "
                     f"{c['lower'] * 100:+.1f}) | {why} |")
    if missing:
        lines.append("\nNot measured (a record missing): " + ", ".join(missing) + ".")
    return "\n".join(lines)
