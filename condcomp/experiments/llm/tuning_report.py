"""The summary of ``condcomp tune-llm``: one markdown table row per variant, and perplexity against KV fraction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from condcomp.experiments.llm.variants import parse_decode_variant


def _f(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def summary_table(records: list[dict[str, Any]], decode_at: tuple[int, int] | None = None) -> str:
    """Markdown: KV fraction, query-head fraction, budget, how often a request's kept groups differ from the layer's
    most common set (``plan_variety``), held-out perplexity (overall and per dataset),
    token agreement of greedy continuations with the untuned and the tuned dense model's, tuning seconds;
    skipped and failed variants say why."""
    datasets: list[str] = []
    for r in records:
        for d in (r.get("perplexity") or {}).get("per_dataset", {}):
            if d not in datasets:
                datasets.append(d)
    head = ["variant", "KV frac", "heads frac", "s_mean", "plans varied", "ppl", *[f"ppl {d}" for d in datasets],
            "agree dense", "agree tuned", "tune CPU s"]
    if decode_at is not None:
        head += [f"decode x dense (P{decode_at[0]} B{decode_at[1]})", f"KV MiB (P{decode_at[0]} B{decode_at[1]})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        if r.get("status") != "done":
            reason = str(r.get("reason", "")).replace("|", "/")
            lines.append(f"| {r['variant']} | {r.get('status')}: {reason} |" + " |" * (len(head) - 2))
            continue
        ppl = r["perplexity"]
        cells = [r["variant"], _f(r.get("kv_fraction")), _f(r.get("k_frac")), _f(r.get("s_mean")),
                 _f(r.get("plan_variety")), _f(ppl["ppl"]),
                 *[_f(ppl["per_dataset"].get(d, {}).get("ppl")) for d in datasets],
                 _f(r["agreement"]["token_agreement"]), _f((r.get("agreement_tuned") or {}).get("token_agreement")),
                 _f(_tune_seconds(r), 0)]
        if decode_at is not None:
            cells += [_f((r.get("decode") or {}).get("ratio")), _f(_mib((r.get("decode") or {}).get("kv_bytes")), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_ppl_vs_kv(results: Path, path: Path) -> Path | None:
    """Perplexity against KV fraction (dense, MoH, per-request, static); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    rows = json.loads((results / "summary.json").read_text())
    styles = {"dense": ("black", "o"), "moh": ("tab:purple", "^"), "request": ("tab:blue", "s"),
              "request (warm start)": ("tab:cyan", "s"), "budgetformer": ("tab:green", "D"),
              "static": ("tab:red", "x")}
    fig, ax = plt.subplots(figsize=(6, 4))
    for series, (kind, (color, marker)) in enumerate(styles.items()):
        pts = sorted((r["kv_fraction"], r["ppl"], r["variant"]) for r in rows
                     if r.get("status") == "done" and _kind(r["variant"]) == kind)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=kind,
                linestyle="-" if len(pts) > 1 and kind != "dense" else "none")
        for x, y, name in pts:  # staggered by series: rows at one KV fraction often sit close together
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 9 * (series % 3) - 9), fontsize=7,
                        color=color)
    ax.set_xlim(0.0, 1.15)
    ax.set_yscale("log")  # tuned rows sit near 40, heavily pruned ones in the hundreds
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("KV cache fraction kept (KV groups)")
    ax.set_ylabel("held-out perplexity (continuation tokens)")
    ax.set_title("SmolLM2-135M: quality against KV memory")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_decode_records(paths: list[Path], model: str = "smollm2") -> list[dict[str, Any]]:
    """The records of ``condcomp bench decode`` runs of ``model`` (each folder's ``metrics.json``, or the file)."""
    records: list[dict[str, Any]] = []
    for given in paths:
        path = Path(given) / "metrics.json" if Path(given).is_dir() else Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"--decode-results {given}: no metrics.json there (write one with "
                                    f"`condcomp bench decode --model {model} --out FOLDER` and pass the folder)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--decode-results {path}: not valid JSON ({err})") from None
        if not isinstance(data, dict) or data.get("benchmark") != "decode" or not isinstance(data.get("records"), list):
            raise ValueError(f"--decode-results {path}: not the metrics.json of `condcomp bench decode`")
        other = sorted({str(r.get("model")) for r in data["records"]} - {model})
        if other:
            raise ValueError(f"--decode-results {path}: measured {', '.join(other)}, not {model}; the table joins "
                             f"decode speed of the model it tuned")
        records += data["records"]
    devices = sorted({str(r.get("device")) for r in records})
    if len(devices) > 1:
        raise ValueError(f"--decode-results mixes devices ({', '.join(devices)}); pass one device's runs")
    return records


def decode_setting(bench: list[dict[str, Any]]) -> tuple[int, int] | None:
    """The ``(prompt, batch)`` every row is joined at: the largest prompt x batch the dense model was run at."""
    cells = [(r["prompt"], r["batch"]) for r in bench if r["variant"] == "dense"]
    return max(cells, key=lambda c: (c[0] * c[1], c)) if cells else None


def decode_of(row: dict[str, Any], bench: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The decode benchmark's cell for a variant at :func:`decode_setting`: ``dense`` for the dense rows,
    ``moh_<f>`` at the variant's head fraction for MoH, ``keep_<f>`` at its KV fraction for static and
    per-request plans (speed depends on how many groups are kept, not which). Ratios are to the dense model of
    the same benchmark run. None where no cell matches (BudgetFormer: its kept fraction varies by request)."""
    name, setting = row["variant"], decode_setting(bench)
    if setting is None:
        return None
    if name.startswith("dense"):
        want: tuple[str, float] = ("dense", 1.0)
    elif name.startswith("moh_"):
        want = ("moh", int(name[4:]) / 100)
    elif name.startswith(("static", "request")) and row.get("kv_fraction") is not None:
        want = ("keep", float(row["kv_fraction"]))
    else:
        return None
    for r in bench:
        kind, f = parse_decode_variant(r["variant"])
        if (r["prompt"], r["batch"]) == setting and kind == want[0] and abs(f - want[1]) < 0.01:
            return {"bench_variant": r["variant"], "prompt": r["prompt"], "batch": r["batch"],
                    "ms_per_token": r["decode_ms_per_token"], "ratio": r["decode_ratio"], "kv_bytes": r["kv_bytes"]}
    return None


def _mib(n: float | None) -> float | None:
    return None if n is None else n / 2**20


def _kind(variant: str) -> str:
    """The plot's series of a variant: its name's first word, warm-started per-request plans apart."""
    kind = variant.split("_")[0]
    return f"{kind} (warm start)" if variant.endswith("_warm") else kind


def _tune_seconds(r: dict[str, Any]) -> float | None:
    """CPU seconds of the tuning; None where only wall-clock seconds were recorded (metrics.json has them)."""
    return (r.get("tuning") or {}).get("cpu_seconds") or None
