"""What ``condcomp bench kv`` writes: one record per variant and prompt length, the table with ratios to dense,
the samples, and the plot of quality against measured KV bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from condcomp.bench.kv_variants import PLANNED_VARIANTS, VARIANTS


def length_record(name: str, prompt_len: int, r: dict[str, Any], dense: dict[str, Any],
                  settings: dict[str, Any]) -> dict[str, Any]:
    """One variant at one prompt length, from :func:`condcomp.bench.kv.measure_length`'s tallies."""
    nll = r["nll_sum"] / r["tokens"]
    cases = len(r["hits"])
    return {"variant": name, "prompt_len": prompt_len, "task": settings.get("task", "passkey"),
            "kv_bytes": r["kv_bytes"], "kv_frac": r["kv_bytes"] / dense["kv_bytes"], "nll": nll, "ppl": math.exp(nll),
            "ppl_tokens": r["tokens"], "token_nll": r["token_nll"],
            "retrieval_acc": sum(r["hits"]) / cases, "retrieval_n": cases, "retrieval_correct": r["hits"],
            "retrieval_by_depth": {d: hits / n for d, (hits, n) in sorted(r["by_depth"].items())},
            "samples": r["samples"], "note": VARIANTS[name].note, "settings": settings}


def correct(r: dict[str, Any]) -> list[bool] | None:
    """A record's per-case retrieval results (``passkey_correct`` in records written before the facts task)."""
    found = r.get("retrieval_correct", r.get("passkey_correct"))
    return None if found is None else [bool(x) for x in found]


def accuracy(r: dict[str, Any]) -> float:
    return float(r.get("retrieval_acc", r.get("passkey_acc", math.nan)))


def merged(length: dict[str, Any] | None, decode: dict[str, Any] | None) -> dict[str, Any]:
    """A length record with the variant's decode timing (measured once, at the preset's decode prompt and batch)."""
    if length is None:
        raise RuntimeError("a (variant, prompt length) record is missing after the run measured it")
    timing = decode or {}
    s = timing.get("settings", {})
    return {**{k: v for k, v in length.items() if k != "settings"},
            "decode_ms_per_token": timing.get("decode_ms_per_token"), "decode_ratio": timing.get("decode_ratio"),
            "decode_prompt": s.get("decode_prompt"), "decode_batch": s.get("decode_batch"),
            "decode_kv_bytes": timing.get("decode_kv_bytes")}


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def paired_with_dense(r: dict[str, Any], dense: dict[str, Any]) -> str:
    """The passkey cases only the variant found / only dense found, and the exact McNemar p of that split: the
    cases are the same prompts for every variant, so this pairs them. '-' for dense, for records written before
    per-case results were kept."""
    from condcomp.experiments.stats import mcnemar

    a, d = correct(r), correct(dense)
    if r is dense or not a or not d or len(a) != len(d):
        return "-"
    t = mcnemar(a, d)
    return f"{t['a_only']} / {t['b_only']}, p {t['p']:.2f}"


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: per prompt length and variant, the measured values and their ratios to dense's."""
    dense = {r["prompt_len"]: r for r in records if r["variant"] == "dense"}
    lines = ["| prompt | variant | kv_frac | KV MiB | ppl | x dense | passkey acc (n) | x dense | passkey only it / "
             "only dense, McNemar p | decode ms/token | x dense |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        d = dense[r["prompt_len"]]
        ms = "-" if r["decode_ms_per_token"] is None else f"{r['decode_ms_per_token']:.1f}"
        acc_ratio = _ratio(accuracy(r), accuracy(d)) if accuracy(d) else "(dense 0)"
        decode = "-" if r["decode_ratio"] is None else f"{r['decode_ratio']:.2f}"
        lines.append(f"| {r['prompt_len']} | {r['variant']} | {r['kv_frac']:.3f} | {r['kv_bytes'] / 2**20:.1f} | "
                     f"{r['ppl']:.2f} | {_ratio(r['ppl'], d['ppl'])} | {accuracy(r):.2f} ({len(correct(r) or [])}) | "
                     f"{acc_ratio} | {paired_with_dense(r, d)} | {ms} | {decode} |")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> str:
    p = result["preset"]
    records = result["records"]
    timing = next((r for r in records if r["decode_prompt"] is not None), None)
    lines = ["# condcomp bench kv", "",
             f"Prompts {', '.join(map(str, p['prompts']))} tokens; passkey cases {p['passkey_cases']} and "
             f"continuations {p['ppl_cases']} of {p['cont_len']} scored tokens (per length where a list); "
             f"passkey prompt format {p.get('passkey_format', 'raw')}; device {result['device']}, "
             f"{result['threads']} threads.",
             f"Decode ms/token: prompt {p['decode_prompt']}, batch {p['decode_batch']}, median of "
             f"{p['decode_tokens']} interleaved steps ('x dense': step-paired median ratio)." if timing else "", "",
             table(records), "", "## Variants", ""]
    lines += [f"- `{n}`: {VARIANTS[n].note}" for n in dict.fromkeys(r["variant"] for r in records)]
    if result["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {reason}" for reason in result["skipped"].values()]
    if PLANNED_VARIANTS:
        lines += ["", f"Still to come: {', '.join(PLANNED_VARIANTS)}."]
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> bool:
    """Perplexity (x dense) and passkey accuracy against kv_frac, one panel each; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dense = {r["prompt_len"]: r for r in records if r["variant"] == "dense"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(dict.fromkeys(r["variant"] for r in records))
    color = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}  # one colour per variant
    for P, marker in zip(sorted(dense), "os^D"):
        rows = [r for r in records if r["prompt_len"] == P]
        for ax, key in zip(axes, ("ppl", "retrieval")):
            for r in rows:
                y = r["ppl"] / dense[P]["ppl"] if key == "ppl" else accuracy(r)
                ax.scatter(r["kv_frac"], y, marker=marker, color=color[r["variant"]], label=f"{r['variant']} @ {P}")
    axes[0].set(xlabel="KV bytes / dense", ylabel="continuation perplexity / dense", yscale="log")
    axes[1].set(xlabel="KV bytes / dense", ylabel="passkey accuracy", ylim=(-0.05, 1.05))
    axes[1].legend(fontsize=6, loc="lower right")
    fig.suptitle("Quality per KV byte (markers: prompt lengths)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(out: Path, result: dict[str, Any]) -> None:
    """``metrics.json`` (samples apart), ``samples.json``, ``summary.md`` and ``quality_vs_kv.png``."""
    slim = [{k: v for k, v in r.items() if k != "samples"} for r in result["records"]]
    (out / "metrics.json").write_text(json.dumps({**result, "records": slim}, indent=1))
    samples = {f"{r['variant']}@{r['prompt_len']}": r["samples"] for r in result["records"]}
    (out / "samples.json").write_text(json.dumps(samples, indent=1))
    (out / "summary.md").write_text(summary(result))
    plot(result["records"], out / "quality_vs_kv.png")
