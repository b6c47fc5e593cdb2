"""``auto``'s CUDA thresholds fitted from a ``condcomp bench gpu-check`` record (``tuning.json``).

``executor="auto"`` runs dense attention (``masked``) instead of ``gathered`` when a plan skips little: when the
skipped work ``(1 - s) * B*T*D`` is below ``min_skipped_work_<granularity>`` or the kept share ``s`` is at least
``dense_work_<granularity>`` (:meth:`~condcomp.executors.gathered.GatheredTuning.prefers_dense`). The CUDA values in
``executors/gathered/tuning.py`` are a guess (``measured=False``) until a GPU record exists. This module reads the
record's timed cells, marks each (shape, plan granularity, s) where ``gathered`` beat ``masked`` in every pass timed
(paired medians, one dtype), and picks the two thresholds that reproduce most of those wins and losses, breaking ties
toward dense (the path with no skipping to get wrong). It writes the fit and every cell's verdict; a person copies
the values into the CUDA tuning with ``measured=True`` and commits the record beside it.
"""

from __future__ import annotations

import math
from typing import Any

GRANULARITIES = ("sequence", "token")


def cell_wins(records: list[dict[str, Any]], dtype: str) -> dict[str, list[dict[str, Any]]]:
    """Per granularity, one entry per timed cell of ``dtype``: its skipped work, its kept share ``s`` and whether
    ``gathered`` was faster than ``masked`` in every pass both were timed in (cells missing either are left out)."""
    ratios: dict[tuple, dict[str, dict[str, float]]] = {}
    for r in records:
        if r["dtype"] != dtype or r["variant"] not in ("gathered", "masked"):
            continue
        sh = r["shape"]
        key = (r["granularity"], sh["B"], sh["T"], sh["D"], sh["H"], r["s"])
        ratios.setdefault(key, {}).setdefault(r["pass"], {})[r["variant"]] = r["paired_to_dense"]
    cells: dict[str, list[dict[str, Any]]] = {g: [] for g in GRANULARITIES}
    for (granularity, B, T, D, H, s), passes in sorted(ratios.items()):
        both = {p: v for p, v in passes.items() if "gathered" in v and "masked" in v}
        if not both or granularity not in cells:
            continue
        cells[granularity].append({
            "shape": {"B": B, "T": T, "D": D, "H": H}, "s": s, "skipped_work": (1.0 - s) * B * T * D,
            "gathered_wins": all(v["gathered"] < v["masked"] for v in both.values()),
            "passes": sorted(both), "gathered_over_masked": {p: round(v["gathered"] / v["masked"], 4)
                                                             for p, v in sorted(both.items())}})
    return cells


def _prefers_dense(cell: dict[str, Any], min_skipped: float, dense_share: float) -> bool:
    """The rule of ``GatheredTuning.prefers_dense`` on one cell."""
    return cell["skipped_work"] < min_skipped or cell["s"] >= dense_share


def fit(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The (``min_skipped_work``, ``dense_work``) pair that agrees with the most cells' verdicts (None: no cells).

    Candidates are the cells' own values (a threshold between two measured cells sits at the larger one) plus "never"
    and "always"; ties go to the larger ``min_skipped_work`` and then the smaller ``dense_work`` (more calls dense)."""
    if not cells:
        return None
    skipped = sorted({c["skipped_work"] for c in cells}) + [math.inf]
    shares = sorted({c["s"] for c in cells}) + [math.inf]
    best: tuple[tuple[int, float, float], float, float] | None = None
    for m in [0.0, *skipped]:
        for d in shares:
            agree = sum(_prefers_dense(c, m, d) != c["gathered_wins"] for c in cells)
            key = (agree, m, -d)
            if best is None or key > best[0]:
                best = (key, m, d)
    assert best is not None
    (agree, _, _), m, d = best
    return {"min_skipped_work": m, "dense_work": d, "agree": agree, "cells": len(cells),
            "disagree": [c for c in cells if _prefers_dense(c, m, d) == c["gathered_wins"]]}


def tuning_fields(fits: dict[str, dict[str, Any] | None], on_cuda: bool = True) -> dict[str, Any]:
    """``GatheredTuning`` keyword arguments from the fits (a granularity with no cells keeps its current value):
    infinite thresholds become the largest value the options accept, 2**40 (never gathered) and 1.0. ``measured``
    is False unless the cells were timed on CUDA (a CPU dry run fits CPU timings, not the CUDA tuning's)."""
    fields: dict[str, Any] = {"measured": on_cuda}
    for granularity, f in fits.items():
        if f is None:
            continue
        m = f["min_skipped_work"]
        fields[f"min_skipped_work_{granularity}"] = int(min(m, 2**40)) if math.isfinite(m) else 2**40
        fields[f"dense_work_{granularity}"] = min(float(f["dense_work"]), 1.0)
    return fields


def tuning_record(records: list[dict[str, Any]], dtype: str = "bfloat16", on_cuda: bool = True) -> dict[str, Any]:
    """What ``tuning.json`` holds: the dtype fitted, each granularity's cells and fit, and the proposed fields
    (``on_cuda``: whether the cells were timed on CUDA, which the CUDA tuning needs)."""
    cells = cell_wins(records, dtype)
    fits = {g: fit(c) for g, c in cells.items()}
    return {"dtype": dtype, "on_cuda": on_cuda, "fields": tuning_fields(fits, on_cuda), "fits": fits, "cells": cells,
            "rule": "auto runs masked when (1 - s) * B*T*D < min_skipped_work or s >= dense_work"}


def tuning_lines(record: dict[str, Any]) -> list[str]:
    """``table.md``'s section: the proposed CUDA fields and how many cells each fit reproduces."""
    if record.get("on_cuda", True):
        lines = [f"auto's CUDA thresholds fitted to this run's {record['dtype']} cells (tuning.json; copy them into "
                 "`executors/gathered/tuning.py`'s CUDA tuning with `measured=True`):", ""]
    else:
        lines = [f"auto's thresholds fitted to this run's {record['dtype']} cells, timed off CUDA (a dry run: not for "
                 "the CUDA tuning; tuning.json says `measured: false`):", ""]
    for g, f in record["fits"].items():
        if f is None:
            lines.append(f"- {g} plans: no cell with both gathered and masked timed")
            continue
        lines.append(f"- {g} plans: min_skipped_work {f['min_skipped_work']:g}, dense_work {f['dense_work']:g}: "
                     f"reproduces {f['agree']} of {f['cells']} cells' faster path")
    return lines


__all__ = ["cell_wins", "fit", "tuning_fields", "tuning_lines", "tuning_record"]
