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
    """The retrieval cases only the variant found / only dense found, and the exact McNemar p of that split: the
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
    lines = ["| prompt | variant | kv_frac | KV MiB | ppl | x dense | retrieval acc (n) | x dense | found only it / "
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


FAMILIES = (("dense", "dense"), ("quantized-", "quantized cache"), ("kvpress-", "kvpress"),
            ("streaming", "window (StreamingLLM)"), ("drop-", "condcomp drop"), ("split-", "condcomp split"),
            ("router-", "condcomp router"), ("snapkv-", "condcomp token selection"),
            ("adakv-", "condcomp token selection"), ("headkv-", "condcomp per-group budgets"))


def family(name: str) -> str:
    """The plot's colour group of a variant: its kind, with ' + quantized' when composed with a quantized cache.

    >>> family("split-static-1of3+fp8"), family("kvpress-snapkv-0.50"), family("quantized-hqq4")
    ('condcomp split + quantized', 'kvpress', 'quantized cache')
    """
    base, _, composed = name.partition("+")
    kind = next((label for prefix, label in FAMILIES if base.startswith(prefix)), "other")
    return kind + (" + quantized" if composed else "")


def held_fraction(r: dict[str, Any]) -> float:
    """The KV fraction a variant is compared at: its measured bytes, or a head-wise press's nominal fraction (the
    bytes it would hold if its masked keys were freed)."""
    return r["nominal_frac"] if r.get("nominal_frac") is not None else r["kv_frac"]


def best_kvpress(rows: list[dict[str, Any]], at_least: float = 0.0, tol: float = 0.01) -> dict[str, Any] | None:
    """The kvpress variant of one prompt length with the most retrieval cases found among those holding at least
    ``at_least`` of the dense bytes (within ``tol``): beating it beats every press at equal or larger bytes."""
    presses = [r for r in rows if family(r["variant"]) == "kvpress" and correct(r)
               and held_fraction(r) >= at_least - tol]
    return max(presses, key=lambda r: sum(correct(r) or []), default=None)


def pareto(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records no other of the same prompt length dominates in retrieval per measured byte: none holds at most
    its bytes (``kv_frac``) and finds at least as many cases, one of the two strictly. Per length, in bytes order;
    records without retrieval results are left out.

    >>> rows = [{"variant": v, "prompt_len": 8, "kv_frac": f, "retrieval_acc": a}
    ...         for v, f, a in (("a", 1.0, 0.8), ("b", 0.5, 0.6), ("c", 0.5, 0.4), ("d", 0.25, 0.6))]
    >>> [r["variant"] for r in pareto(rows)]
    ['d', 'a']
    """
    out = []
    for P in dict.fromkeys(r["prompt_len"] for r in records):
        rows = [r for r in records if r["prompt_len"] == P and not math.isnan(accuracy(r))]
        out += sorted((r for r in rows if not any(
            o["kv_frac"] <= r["kv_frac"] and accuracy(o) >= accuracy(r)
            and (o["kv_frac"], accuracy(o)) != (r["kv_frac"], accuracy(r)) for o in rows)), key=lambda r: r["kv_frac"])
    return out


def statistics_table(records: list[dict[str, Any]], cfg: Any = None) -> str:
    """Markdown, per prompt length and variant: retrieval with its Wilson interval, the exact McNemar test against
    dense and against the best kvpress press, the non-inferiority bound against dense, and perplexity / dense's with
    its paired bootstrap interval over tokens."""
    from condcomp.bench.kv_stats import KVStats, mcnemar, noninferiority, ppl_ratio, wilson

    cfg = cfg or KVStats()
    lines = [f"| prompt | variant | kv_frac | retrieval (Wilson {cfg.confidence:.0%}) | vs dense: only it / only "
             f"dense, McNemar p | acc - dense, one-sided {1 - cfg.alpha:.0%} lower bound | within "
             f"{cfg.margin * 100:.0f} points | vs the best kvpress press at >= its bytes: only it / only the press, p "
             f"| ppl x dense "
             f"[{cfg.confidence:.0%} bootstrap] |", "|---|---|---|---|---|---|---|---|---|"]
    for P in dict.fromkeys(r["prompt_len"] for r in records):
        rows = [r for r in records if r["prompt_len"] == P]
        dense = next(r for r in rows if r["variant"] == "dense")
        for r in rows:
            best = best_kvpress(rows, held_fraction(r))
            hits, d = correct(r) or [], correct(dense) or []
            lo, hi = wilson(sum(hits), len(hits), cfg.confidence) if hits else (math.nan, math.nan)
            vs_dense = ni = within = vs_best = "-"
            if r is not dense and hits and len(hits) == len(d):
                t = mcnemar(hits, d)
                vs_dense = f"{t['a_only']} / {t['b_only']}, p {t['p']:.3f}"
                n_i = noninferiority(hits, d, cfg)
                ni = f"{n_i['diff'] * 100:+.1f} (>= {n_i['lower'] * 100:+.1f})"
                within = "yes" if n_i["non_inferior"] else "no"
            if best is not None and r is not best and hits:
                t = mcnemar(hits, correct(best) or [])
                vs_best = f"{t['a_only']} / {t['b_only']} ({best['variant']}), p {t['p']:.3f}"
            ppl = "-"
            if r.get("token_nll") and dense.get("token_nll"):
                q = ppl_ratio(r["token_nll"], dense["token_nll"], cfg)
                ppl = f"{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}]"
            nominal = f" (nominal {r['nominal_frac']:.2f})" if r.get("nominal_frac") is not None else ""
            lines.append(f"| {P} | {r['variant']} | {r['kv_frac']:.3f}{nominal} | {sum(hits)} / {len(hits)} "
                         f"[{lo:.2f}, {hi:.2f}] | {vs_dense} | {ni} | {within} | {vs_best} | {ppl} |")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> str:
    p = result["preset"]
    records = result["records"]
    timing = next((r for r in records if r["decode_prompt"] is not None), None)
    task = p.get("task", "passkey")
    asked = ("inside the context" if p.get("question_in_context") else
             "question-aware: compressed with the context but its last token, fed after it through the cache"
             if p.get("question_aware") else "after the context, through the cache") if (
        task in ("facts", "quotes")) else "inside the prompt"
    sep = {"blank": "a blank line", "eos": "<|endoftext|>"}[p.get("haystack_sep") or (
        "blank" if task in ("facts", "quotes") and "haystack_sep" in p else "eos")]  # runs before the option: eos
    facts = (f"{p.get('facts', 4)} facts per context, question form {p.get('question_form', 'qa')}, documents "
             f"separated by {sep}, ") if task == "facts" else ""
    if task == "quotes":
        from condcomp.bench.kv_quotes import ANSWER_WORDS, CUE_TOKENS

        facts = (f"{CUE_TOKENS} tokens of the context quoted, found when the answer's first {ANSWER_WORDS} words "
                 f"follow them, documents separated by {sep}; ")
    lines = ["# condcomp bench kv" + (": question-aware" if task == "facts" and p.get("question_aware") else ""), "",
             f"Prompts {', '.join(map(str, p['prompts']))} tokens; retrieval task {task} ({facts}the question "
             f"{asked}); retrieval cases {p['passkey_cases']} and continuations {p['ppl_cases']} of {p['cont_len']} "
             f"scored tokens (per length where a list); haystack text {result.get('text', 'staged')}; device "
             f"{result['device']}, {result['threads']} threads.",
             f"Decode ms/token: prompt {p['decode_prompt']}, batch {p['decode_batch']}, median of "
             f"{p['decode_tokens']} interleaved steps ('x dense': step-paired median ratio)." if timing else
             "Decode not timed (--time-decode without names times none; name the variants to time, or leave the "
             "flag out to time every one).", "",
             table(records), ""]
    try:
        lines += ["## Paired statistics", "", statistics_table(records), "",
                  "Non-inferiority: Newcombe's paired interval (method 10); perplexity intervals resample tokens "
                  "(windows' tokens are not independent: the token-level part of the uncertainty).", ""]
    except ImportError:
        lines += ["(Paired statistics need scipy: pip install 'condcomp[report]'.)", ""]
    lines += ["## Pareto set", "", "Retrieval per measured byte: no other variant holds at most the bytes and finds at "
              "least as many cases (one of the two strictly).", ""]
    lines += [f"- {r['prompt_len']}: `{r['variant']}` {r['kv_frac']:.3f}x, {accuracy(r):.2f} "
              f"({len(correct(r) or [])} cases)" for r in pareto(records)]
    lines += ["", "## Variants", ""]
    lines += [f"- `{n}`: {note}" for n, note in dict.fromkeys((r["variant"], r.get("note", "")) for r in records)]
    if result["skipped"]:
        lines += ["", "## Skipped", ""] + [f"- {reason}" for reason in result["skipped"].values()]
    if PLANNED_VARIANTS:
        lines += ["", f"Still to come: {', '.join(PLANNED_VARIANTS)}."]
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> bool:
    """Retrieval accuracy and perplexity (x dense) against measured KV bytes / dense, one colour per family
    (:func:`family`), one marker per prompt length, the legend outside the axes; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dense = {r["prompt_len"]: r for r in records if r["variant"] == "dense"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    families = list(dict.fromkeys(family(r["variant"]) for r in records))
    # tab10 without its grey (index 7), which the prompt-length and nominal-bytes keys use; tab20 past nine
    palette = [plt.get_cmap("tab10")(i) for i in range(10) if i != 7] if len(families) <= 9 else \
        [plt.get_cmap("tab20")(i) for i in range(20) if i not in (14, 15)]
    color = {f: palette[i % len(palette)] for i, f in enumerate(families)}
    markers = dict(zip(sorted(dense), "os^Dv"))
    for r in records:
        ys = (accuracy(r), r["ppl"] / dense[r["prompt_len"]]["ppl"])
        c, m = color[family(r["variant"])], markers.get(r["prompt_len"], "o")
        for ax, y in zip(axes, ys):
            ax.scatter(r["kv_frac"], y, marker=m, color=c)
            if r.get("nominal_frac") is not None:  # a head-wise press: hollow at the bytes it would hold if freed
                ax.scatter(r["nominal_frac"], y, marker=m, facecolors="none", edgecolors=c)
                ax.plot([r["nominal_frac"], r["kv_frac"]], [y, y], ls=":", color=c, lw=0.8)
        if (ci := _wilson_or_none(r)) is not None:  # retrieval's 95 % Wilson interval
            axes[0].plot([r["kv_frac"]] * 2, ci, color=c, lw=0.8, alpha=0.6)
    front = pareto(records)
    for P in dict.fromkeys(r["prompt_len"] for r in front):
        pts = [(r["kv_frac"], accuracy(r)) for r in front if r["prompt_len"] == P]
        axes[0].step(*zip(*pts), where="post", color="black", lw=0.8, ls="--")
    axes[0].set(xlabel="KV bytes held / dense (measured)", ylabel="retrieval accuracy", ylim=(-0.05, 1.05))
    axes[1].set(xlabel="KV bytes held / dense (measured)", ylabel="continuation perplexity / dense")
    handles = [plt.Line2D([], [], ls="", marker="o", color=color[f], label=f) for f in families]
    handles += [plt.Line2D([], [], ls="", marker=m, color="grey", label=f"marker: prompt {P} tokens")
                for P, m in markers.items()]
    handles.append(plt.Line2D([], [], ls=":", marker="o", mfc="none", color="grey",
                              label="hollow: nominal bytes (masked, not freed)"))
    handles.append(plt.Line2D([], [], ls="--", color="black", lw=0.8, label="Pareto set (retrieval per byte)"))
    handles.append(plt.Line2D([], [], ls="-", color="grey", lw=0.8, label="bar: 95 % Wilson interval"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(0.81, 0.5), fontsize=8, frameon=False)
    fig.suptitle("Quality per KV byte")
    fig.tight_layout(rect=(0, 0, 0.8, 1))  # the legend's column right of the panels, outside the data
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the figure grows to hold the legend's longest label
    plt.close(fig)
    return True


def _wilson_or_none(r: dict[str, Any]) -> tuple[float, float] | None:
    """A record's retrieval Wilson interval, or None without per-case results or scipy."""
    hits = correct(r)
    if not hits:
        return None
    try:
        from condcomp.bench.kv_stats import wilson

        return wilson(sum(hits), len(hits))
    except ImportError:
        return None


def write(out: Path, result: dict[str, Any]) -> None:
    """``metrics.json`` (samples apart), ``samples.json``, ``summary.md`` and ``quality_vs_kv.png``."""
    slim = [{k: v for k, v in r.items() if k != "samples"} for r in result["records"]]
    (out / "metrics.json").write_text(json.dumps({**result, "records": slim}, indent=1))
    samples = {f"{r['variant']}@{r['prompt_len']}": r.get("samples", []) for r in result["records"]}
    (out / "samples.json").write_text(json.dumps(samples, indent=1))
    (out / "summary.md").write_text(summary(result))
    plot(result["records"], out / "quality_vs_kv.png")
