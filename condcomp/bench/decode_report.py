"""``condcomp bench decode``'s records as files: ``table.md`` (:func:`table`) and ``metrics.json``, rewritten after
every cell (:func:`write`), so a run cut short by a time limit keeps the cells it finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def table(records: list[dict[str, Any]]) -> str:
    compiled = any("compiles" in r for r in records)  # --compile: the graphs each run compiled (1 = warm-up only)
    lines = ["| prompt | batch | variant | heads/token | prefill ms | x dense | decode ms/token | x dense | KV MiB | "
             "x dense | peak memory MiB | tokens = dense |" + (" compiles | x faster dense |" if compiled else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if compiled else "")]
    for r in records:
        rss = f"{r['peak_memory_bytes'] / 2**20:.0f}" if r['peak_memory_bytes'] else "n/a"
        heads = f"{r['k_frac']:.2f}" if r.get("k_frac") is not None else "-"
        lines.append(f"| {r['prompt']} | {r['batch']} | {r['variant']} | {heads} | {r['prefill_ms']:.1f} | "
                     f"{r['prefill_ratio']:.2f} | {r['decode_ms_per_token']:.2f} | {r['decode_ratio']:.2f} | "
                     f"{r['kv_bytes'] / 2**20:.1f} | {r['kv_ratio']:.2f} | {rss} | {r['tokens_equal_dense']} |"
                     + (f" {r['compiles'] if r.get('compiled') else '-'} | {r['decode_ratio_faster_dense']:.2f} |"
                        if compiled else ""))
    return "\n".join(lines)


def write(out: Path, records: list[dict[str, Any]], stopped: str | None = None) -> str:
    """Write ``metrics.json`` and ``table.md`` into ``out``; ``stopped``: why the run stopped early (also read from
    the records, which carry it for the cell it stopped in), said at the top of the JSON and under the table.
    Returns the table's text."""
    stopped = stopped or next((r["stopped"] for r in records if r.get("stopped")), None)
    skipped = [f"{r['variant']} ({r['prompt']} x {r['batch']})" for r in records if r.get("graph_skips")]
    text = table(records)
    if skipped:
        text += ("\n\nCompiled without CUDA graphs (inductor skipped them; TORCH_LOGS=cudagraphs says why): "
                 f"{', '.join(skipped)}.")
    if stopped:
        text += (f"\n\nStopped ({stopped}): the last cell's rows are over the steps that ran (a compiled variant's "
                 "first step includes compiling it), and its token comparisons over the tokens decoded.")
    (out / "metrics.json").write_text(json.dumps({"benchmark": "decode", "records": records,
                                                  **({"stopped": stopped} if stopped else {})}, indent=1))
    (out / "table.md").write_text(text + "\n")
    return text
