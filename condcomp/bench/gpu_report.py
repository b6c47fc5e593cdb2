"""``table.md`` of ``condcomp bench gpu-check``: how the run was made, the GPU targets with what this run
measured for each, and one row per timed cell and pass. Every ratio is a paired one (the median over repetitions of
the variant's time over dense's, or the floor's, in the same repetition)."""

from __future__ import annotations

from typing import Any

from condcomp.bench.gpu_cells import COMPILED, TARGETS, Target

GATHERED = "gathered"


def _gathered_variants(rows: dict[str, dict[str, Any]]) -> list[str]:
    """``gathered`` first, then each strategy in the order recorded, then the compiled path."""
    names = [v for v in rows if v.startswith(GATHERED)]
    return sorted(names, key=lambda v: (v != GATHERED, v == COMPILED))


def _by_cell(records: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    rows: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        sh = r["shape"]
        key = (sh["B"], sh["T"], sh["D"], sh["H"], r["granularity"], r["s"], r["dtype"], r["pass"])
        rows.setdefault(key, {})[r["variant"]] = r
    return rows


def target_lines(records: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> list[str]:
    """One row per target: the bound, and each gathered variant's paired ratio (``met`` / ``missed``), or why the
    cell has no measurement."""
    rows = _by_cell(records)
    lines = ["| target (bfloat16) | bound | measured (paired) |", "|---|---|---|"]
    for t in TARGETS:
        key = (*t.shape, t.granularity, t.s, "bfloat16", t.passes)
        name = _target_name(t)
        cell = rows.get(key)
        if not cell:
            lines.append(f"| {name} | <= {t.bound}x {t.versus} | not measured in this run |")
            continue
        parts = []
        for v in _gathered_variants(cell):
            ratio = cell[v][f"paired_to_{t.versus}"]
            parts.append(f"{_variant_label(cell[v])} {ratio:.2f}x ({'met' if ratio <= t.bound else 'missed'})")
        summary = next((s for s in summaries if (s["shape"]["B"], s["shape"]["T"], s["shape"]["D"], s["shape"]["H"],
                                                s["granularity"], s["s"], s["dtype"]) == key[:-1]), None)
        if summary and COMPILED in summary["not_run"]:
            parts.append(f"{COMPILED}: not run ({summary['not_run'][COMPILED][:80]})")
        elif summary and summary.get("graph_skips"):
            parts.append(f"{COMPILED}: {summary['graph_skips']} graph(s) compiled without CUDA graphs")
        lines.append(f"| {name} | <= {t.bound}x {t.versus} | {'; '.join(parts)} |")
    return lines


def _target_name(t: Target) -> str:
    B, T, D, H = t.shape
    plan = "sequence plans" if t.granularity == "sequence" else f"token plans at {t.s:.0%} of heads"
    budget = f", s={t.s}" if t.granularity == "sequence" else ""
    return f"B={B} T={T} D={D} H={H}, {plan}{budget}, {t.passes}"


def _variant_label(r: dict[str, Any]) -> str:
    v = r["variant"]
    return f"gathered (auto: {r['strategy']})" if v == GATHERED else v


def table(header: dict[str, Any], records: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> str:
    """The whole ``table.md``."""
    lines = [f"# condcomp bench gpu-check on {header['device']}", "",
             f"    {header['command']}", "",
             f"Commit {header['commit']}, torch {header['torch']}, started {header['started_utc']}; "
             f"{len(summaries)} of {header.get('cells_total', '?')} cells timed"
             + (f"; stopped: {header['stopped']}" if header.get("stopped") else "")
             + (f"; not started: {', '.join(header['not_started'])}" if header.get("not_started") else "") + ".", "",
             f"Correctness checks against the reference executor: {header.get('checks', 'not recorded')}.", "",
             *(["**--quick**: tiny shapes and 2 repetitions, a smoke test of the command, not a measurement; the "
                "targets below need the full run on a CUDA GPU.", ""] if header.get("quick") else []),
             "## Targets (one H100/H200, bfloat16; the router excluded)", "", *target_lines(records, summaries), "",
             "## Every cell", "",
             "Milliseconds are medians; `xd` / `xf`: paired ratios to dense and to the floor (a dense block of only k "
             "heads). masked and gathered run on the router's plan; the router is its own column.", "",
             "| shape | plan | dtype | pass | s | k | dense ms | floor ms | floor xd | router ms | masked xd "
             "| gathered variants xd / xf |",
             "|" + "---|" * 12]
    for (B, T, D, H, gran, s, dtype, pas), v in _by_cell(records).items():
        d, f = v["dense"], v["floor"]
        router = f"{v['router']['ms']:.3f}" if "router" in v else "-"
        masked = f"{v['masked']['paired_to_dense']:.2f}" if "masked" in v else "-"
        gathered = "; ".join(f"{_variant_label(v[g])} {v[g]['paired_to_dense']:.2f} / {v[g]['paired_to_floor']:.2f}"
                             for g in _gathered_variants(v))
        lines.append(f"| B={B} T={T} D={D} H={H} | {gran} | {dtype} | {pas} | {s} | {d['k']} | {d['ms']:.3f} "
                     f"| {f['ms']:.3f} | {f['paired_to_dense']:.2f} | {router} | {masked} | {gathered} |")
    profiled = [s for s in summaries if s.get("profile", {}).get("calls")]
    if profiled:
        lines += ["", "## Profiles (torch.profiler, per call; host: operators' CPU time, device: GPU busy time)", "",
                  "| cell | variant and pass | wall ms (profiled) | host ms | device ms | operators |",
                  "|---|---|---|---|---|---|"]
        for s in profiled:
            for name, c in s["profile"]["calls"].items():
                dev = "-" if c["device_ms"] is None else f"{c['device_ms']:.3f}"
                lines.append(f"| {s['cell']} | {name} | {c['wall_ms']:.3f} | {c['host_ms']:.3f} | {dev} "
                             f"| [{s['profile']['file']}]({s['profile']['file']}) |")
    if header.get("wrong_answers"):
        lines += ["", "## Wrong answers (gathered vs masked on the same plan, over the checks' tolerance)", "",
                  *(f"- {w}" for w in header["wrong_answers"])]
    not_run = [(s["cell"], name, why) for s in summaries
               for name, why in {**s["not_run"], **{f"gathered[{k}]": "; ".join(r) for k, r in s["rejected"].items()}
                                 }.items()]
    not_run += [(s["cell"], "profile", s["profile"]["error"]) for s in summaries if "error" in s.get("profile", {})]
    if not_run:
        lines += ["", "## Variants that did not run", "", "| cell | variant | why |", "|---|---|---|"]
        lines += [f"| {cell} | {name} | {why.replace('|', '/')} |" for cell, name, why in not_run]
    return "\n".join(lines)
