"""The before/after tables of run_h200.sh's CPU runs (bench decode, bench attention): prints one, writes pairs.json
and pairs.md.

    python results/bench/device/pair_table.py RECORD_FOLDER

For ``bench attention``, RECORD_FOLDER holds ``before/metrics.json`` and ``after/metrics.json``: each masked and
gathered row's time paired to dense in its own process, before and after, and their ratio.

For ``bench decode``, RECORD_FOLDER holds ``before_<cell>/metrics.json`` and ``after_<cell>/metrics.json`` (one
process per cell and code, run at the same time on neighbouring cores). Each process pairs every variant's decode
steps with its own dense model's, so ``decode_ratio`` compares within a process; ``after / before`` compares the two
processes' median ms per token of the same variant (the dense rows give the difference the two cores alone make).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def records(folder: Path, code: str) -> dict[tuple[int, int, str], dict[str, Any]]:
    out = {}
    for path in sorted(folder.glob(f"{code}_p*/metrics.json")):
        for r in json.loads(path.read_text())["records"]:
            key = (r["prompt"], r["batch"], r["variant"])
            if key in out and r["variant"] == "dense":
                continue  # 2048 x 8 runs in two processes, each with its own dense: keep the first
            out[key] = r
    return out


def write(folder: Path, rows: list[dict[str, Any]], lines: list[str]) -> int:
    table = "\n".join(lines)
    print(table)
    (folder / "pairs.json").write_text(json.dumps(rows, indent=1))
    (folder / "pairs.md").write_text(table + "\n")
    return 0


def attention_pairs(folder: Path) -> int:
    def load(code: str) -> dict[tuple[Any, ...], dict[str, Any]]:
        m = json.loads((folder / code / "metrics.json").read_text())
        rows = m if isinstance(m, list) else m["records"]
        return {(tuple(r["shape"].values()), r["granularity"], r["s"], r["variant"], r["pass"]): r for r in rows}

    before, after = load("before"), load("after")
    rows = [{"shape": "x".join(map(str, k[0])), "granularity": k[1], "s": k[2], "variant": k[3], "pass": k[4],
             "before_paired_to_dense": b["paired_to_dense"], "after_paired_to_dense": after[k]["paired_to_dense"],
             "after_over_before": round(after[k]["paired_to_dense"] / b["paired_to_dense"], 3)}
            for k, b in sorted(before.items()) if k in after and k[3] in ("masked", "gathered")]
    lines = ["| shape B x T x D x H | granularity | s | variant | x dense, before | x dense, after | after / before |",
             "|" + "---|" * 7]
    lines += [f"| {r['shape']} | {r['granularity']} | {r['s']} | {r['variant']} | {r['before_paired_to_dense']:.2f} | "
              f"{r['after_paired_to_dense']:.2f} | {r['after_over_before']:.2f} |" for r in rows]
    for variant in ("masked", "gathered"):
        ratios = sorted(r["after_over_before"] for r in rows if r["variant"] == variant)
        lines.append(f"\n{variant}: after / before, median {statistics.median(ratios):.3f}, "
                     f"range {ratios[0]:.2f}-{ratios[-1]:.2f} over {len(ratios)} cells")
    return write(folder, rows, lines)


def main(folder: Path) -> int:
    if (folder / "before" / "metrics.json").is_file():
        return attention_pairs(folder)
    before, after = records(folder, "before"), records(folder, "after")
    rows = []
    for key in sorted(set(before) & set(after)):
        b, a = before[key], after[key]
        rows.append({"prompt": key[0], "batch": key[1], "variant": key[2],
                     "before_decode_ratio": round(b["decode_ratio"], 3),
                     "after_decode_ratio": round(a["decode_ratio"], 3),
                     "before_ms_per_token": round(b["decode_ms_per_token"], 2),
                     "after_ms_per_token": round(a["decode_ms_per_token"], 2),
                     "after_over_before": round(a["decode_ms_per_token"] / b["decode_ms_per_token"], 3),
                     "kv_ratio": round(a["kv_ratio"], 3), "reps": a["reps"], "new_tokens": a["new_tokens"],
                     "tokens_equal_dense_before": b["tokens_equal_dense"],
                     "tokens_equal_dense_after": a["tokens_equal_dense"]})
    head = ("| prompt | batch | variant | decode x dense, before | decode x dense, after | ms/token before | "
            "ms/token after | after / before | KV x dense | tokens = dense (after) |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['batch']} | {r['variant']} | {r['before_decode_ratio']:.2f} | "
                     f"{r['after_decode_ratio']:.2f} | {r['before_ms_per_token']:.1f} | "
                     f"{r['after_ms_per_token']:.1f} | {r['after_over_before']:.2f} | {r['kv_ratio']:.2f} | "
                     f"{r['tokens_equal_dense_after']} |")
    return write(folder, rows, lines)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
