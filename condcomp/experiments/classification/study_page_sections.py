"""The tables of a study's results page (:mod:`.study_page`), one function per section, each returning its
markdown lines: the short verdicts, coverage, the paper's numbers beside ours, the setup, every arm per dataset,
budget vs difficulty and which heads ran. ``rel`` turns a plot's path into the link the page uses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from condcomp.experiments.classification.ablation_stats import is_user_arm
from condcomp.experiments.classification.study_page_questions import QUESTIONS

DATASETS = ("ag_news", "snli", "dbpedia_14", "imdb", "yelp", "digits")
NAMES = {"ag_news": "AG News", "snli": "SNLI", "dbpedia_14": "DBpedia-14 (**re-split**)", "imdb": "IMDB",
         "yelp": "Yelp-5 (**re-split**)", "digits": "digits (ViT, scikit-learn)"}
# BudgetFormer's reported numbers: standard, BudgetFormer, s_mean, FLOPs saved.
PAPER = {"dbpedia_14": (0.9830, 0.9859, 0.085, "~3 %"), "ag_news": (0.9099, 0.9022, 0.212, "~3 %"),
         "imdb": (0.8354, 0.8356, 0.601, "~10 %"), "snli": (0.7835, 0.8106, 0.364, "~2 %"),
         "yelp": (0.5810, 0.6190, 0.198, "~20 %")}
MAIN = ("standard", "budgetformer", "fixed_matched", "moh")
ARM_ORDER = ("standard", "budgetformer", "fixed_matched", "moh", "budgetformer_random_heads",
             "budgetformer_forced_matched", "budgetformer_all_heads")
SEEDS_WANTED = (0, 1, 2)


def _interval(c: dict[str, Any] | None, fmt: str = "{:.4f}", scale: float = 1.0) -> str:
    """``mean [lo, hi]`` of an interval record (one seed: the mean alone; none: ``-``)."""
    if not c or c.get("mean") is None:
        return "-"
    m = fmt.format(c["mean"] * scale)
    if c.get("lo") is None:
        return m  # one seed: no interval (the seeds column says how many)
    return f"{m} [{fmt.format(c['lo'] * scale)}, {fmt.format(c['hi'] * scale)}]"


def _range(rs: list[dict[str, Any]], key: str, fmt: str, scale: float) -> str:
    """``mean (min-max over seeds)`` of a positive quantity such as a latency: a t interval over 3 seeds of a
    drifting machine's timings reaches below zero, a range over the seeds never does."""
    vals = sorted(scale * r[key] for r in rs if r.get(key) is not None)
    if not vals:
        return "-"
    m = fmt.format(sum(vals) / len(vals))
    return m if len(vals) == 1 else f"{m} ({fmt.format(vals[0])}-{fmt.format(vals[-1])})"


def carbon_note(records: list[dict[str, Any]]) -> list[str]:
    """One line, once per page, where some or all records hold no gCO2 (codecarbon missing when they were made)."""
    missing = sum(r.get("inference_gco2") is None for r in records)
    if not missing:
        return []
    how = ("it needs the `carbon` extra (codecarbon), installed from the repository's root with "
           "`pip install -e \".[carbon]\"` before the runs.")
    if missing == len(records):
        return [f"gCO2 is not measured in these records: {how}", ""]
    return [f"gCO2 is the mean over the runs that measured it; \"-\": none of the arm's runs did ({missing} of "
            f"{len(records)} runs were made without codecarbon: {how})", ""]


def _mean_of(rs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rs if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _arms_in_order(arms: set[str]) -> list[str]:
    def key(a: str) -> tuple[int, str]:
        return (ARM_ORDER.index(a), a) if a in ARM_ORDER else (len(ARM_ORDER), a)
    return sorted(arms, key=key)


def coverage_section(records: list[dict[str, Any]], datasets: list[str], project: bool) -> list[str]:
    """``project``: this repository's study, whose plan (every dataset, seeds 0-2) says what is missing."""
    """Which dataset x arm cells have which seeds, and what is missing (``project``: every dataset is wanted)."""
    out: list[str] = ["## Coverage: which cells are done", ""]
    want = [a for a in MAIN if any(r["arm"] == a for r in records)]  # the arms this study runs
    out += ["| dataset | " + " | ".join(want) + " | other arms (seeds) |", "|---|" + "---|" * (len(want) + 1)]
    missing = []
    for ds in datasets:
        rs = [r for r in records if r["dataset"] == ds]
        cells = []
        for arm in want:
            seeds = sorted(r["seed"] for r in rs if r["arm"] == arm)
            cells.append(",".join(map(str, seeds)) or "-")
            lack = [s for s in SEEDS_WANTED if s not in seeds]
            if lack:
                missing.append(f"{ds}/{arm} seeds {','.join(map(str, lack))}")
        others = {a: sorted(r["seed"] for r in rs if r["arm"] == a) for a in {r["arm"] for r in rs} - set(want)}
        cells.append("; ".join(f"{a} ({','.join(map(str, s))})" for a, s in sorted(others.items())) or "-")
        out.append(f"| {NAMES.get(ds, ds)} | " + " | ".join(cells) + " |")
    for ds in DATASETS if project else ():
        if ds not in datasets:
            missing.append(f"{ds}: not run yet")
    if project:
        out += ["", f"Missing for {len(want)} arms x seeds {', '.join(map(str, SEEDS_WANTED))}: "
                + ("; ".join(missing) if missing else "none") + "."]
    return out + [""]


def paper_section(stats: dict[str, Any], datasets: list[str]) -> list[str]:
    """BudgetFormer's reported numbers beside ours."""
    out: list[str] = ["## Our numbers beside the paper's", ""]
    out += ["Paper: BudgetFormer's reported results (4x8x768, 10 epochs, full data, A100). Ours: mean [95 % "
            "t-interval] over the seeds done; FLOPs saved = 1 - analytic FLOP fraction of the whole model.", ""]
    out += ["| dataset | paper std | paper BF | paper s_mean | paper FLOPs saved | our std | our BF | our s_mean | "
            "our heads | our FLOPs saved |", "|---|---|---|---|---|---|---|---|---|---|"]
    for ds in datasets:
        p = PAPER.get(ds)
        arms = (stats.get(ds) or {}).get("arms", {})
        std, bf = arms.get("standard", {}), arms.get("budgetformer", {})
        saved = bf.get("flop_fraction", {}).get("mean")
        ps = [f"{p[0]:.4f}", f"{p[1]:.4f}", f"{p[2]:.3f}", p[3]] if p else ["-"] * 4
        out.append(f"| {NAMES.get(ds, ds)} | " + " | ".join(ps) + f" | {_interval(std.get('accuracy'))} | "
                   f"{_interval(bf.get('accuracy'))} | {_interval(bf.get('s_mean'), '{:.3f}')} | "
                   f"{_interval(bf.get('heads'), '{:.3f}')} | "
                   + (f"{100 * (1 - saved):.1f} %" if saved is not None else "-") + " |")
    out += [""]
    return out


def setup_section(records: list[dict[str, Any]], stats: dict[str, Any], datasets: list[str],
                  project: bool = False) -> list[str]:
    """The model, data and training of each dataset, from the records, and whether the standard model trained enough."""
    out: list[str] = ["## Setup (from the records)", ""]
    out += ["| dataset | model (L x H x d, FFN) | max_len | train rows | test rows | steps | batch | lr | "
            "threads | train s (standard, mean) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for ds in datasets:
        rs = [r for r in records if r["dataset"] == ds and r["arm"] == "standard"] or \
             [r for r in records if r["dataset"] == ds]
        r0 = rs[0]
        m, su = r0.get("model") or {}, r0.get("setup") or {}
        ts = _mean_of(rs, "train_seconds")
        out.append(f"| {NAMES.get(ds, ds)} | {m.get('num_layers')} x {m.get('num_heads')} x {m.get('d_model')}, "
                   f"{m.get('d_ff')} | {su.get('max_len')} | {r0.get('n_train')} | {r0.get('n_test')} | "
                   f"{r0.get('train_steps')} | {su.get('batch_size')} | {su.get('lr')} | {su.get('threads')} | "
                   + (f"{ts:.0f}" if ts else "-") + " |")
    out += [""]
    for ds, goal in (("ag_news", 0.85), ("snli", 0.50)) if project else ():  # the project's training goals
        acc = ((stats.get(ds) or {}).get("arms", {}).get("standard") or {}).get("accuracy") or {}
        if acc.get("mean") is not None:
            ok = "met" if acc["mean"] >= goal else "**not met**"
            out.append(f"- Trained enough? {NAMES[ds]} standard accuracy {acc['mean']:.4f} over {acc['n']} seed(s), "
                       f"goal >= {goal:.2f}: {ok}.")
    return out + versions_lines(records, datasets)


def _version_key(v: str) -> tuple[int, ...]:
    """'0.10.0' after '0.2.0' (string order would put it first); an unparsable version sorts first."""
    parts = v.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else (-1,)


def versions_lines(records: list[dict[str, Any]], datasets: list[str]) -> list[str]:
    """Which condcomp version made which records, where a dataset mixes versions: a BudgetFormer retrained by a
    later version is not the run an earlier record of the same seed was made beside."""
    def version(r: dict[str, Any]) -> str:
        return str((r.get("environment") or {}).get("condcomp") or "unknown")

    mixed = [ds for ds in datasets if len({version(r) for r in records if r["dataset"] == ds}) > 1]
    if not mixed:
        return []
    out = ["", "Records from more than one condcomp version (`environment.condcomp`). A run whose folder is gone "
           "is retrained by the version that runs the study again, and a retrained run need not equal the earlier "
           "run of the same seed. The newer record replaces the earlier one; the controls made from a BudgetFormer "
           "(mode_k, random heads, fixed_per_layer, random_routing) are made again from the new run; "
           "`fixed_matched` keeps its earlier run (the per-seed heads in the questions' tables show whether its "
           "count still matches the new BudgetFormer's). The newer version's records, per dataset:", ""]
    for ds in mixed:
        rows = [r for r in records if r["dataset"] == ds]
        newest = max({version(r) for r in rows}, key=_version_key)
        by_seed: dict[int, list[str]] = {}
        for r in rows:
            if version(r) == newest:
                by_seed.setdefault(r["seed"], []).append(r["arm"])
        seeds = "; ".join(f"seed {seed}: {', '.join(sorted(arms))}" for seed, arms in sorted(by_seed.items()))
        out.append(f"- {NAMES.get(ds, ds)}, {newest}: {seeds}.")
    return out


def per_dataset_section(records: list[dict[str, Any]], stats: dict[str, Any], datasets: list[str], plot_dir: Path,
                        rel: Callable[[Path], str], plots: bool) -> list[str]:
    """Every arm of every dataset: a table, the other paired comparisons and the Pareto plot."""
    out: list[str] = ["## Every arm, per dataset", ""]
    yours = any(is_user_arm(r["arm"]) for r in records)
    out += ["The Pareto plots put every arm at its realised heads (left) and at its analytic FLOP fraction of the "
            "whole model (right; MoH's per-token routing saves less compute than its head share suggests), one "
            "colour per arm (the legend, outside the axes, names them) and one marker per family: the fixed top-k "
            "sweep `fixed_<f>` (squares joined by a grey line, the fixed-budget frontier; `fixed_1` is the standard "
            "model), fixed top-k at the matched or per-layer counts (diamonds, not joined: they mix head counts), "
            "BudgetFormer with the paper's loss and with a price on heads (circles), MoH (triangles), "
            + ("your components `router_<key>` / `policy_<key>` (plus signs), " if yours else "")
            + "controls (crosses). Each point is the mean over seeds with its 95 % t-interval over seeds; a one-seed "
            "point carries the binomial 95 % interval of its test accuracy instead (dashed), which leaves out the "
            "seed-to-seed spread. Faint dots: the single seeds.", ""]
    out += ["Mean [95 % t-interval over seeds] (one seed: no interval). Latency in ms (median of one forward; "
            "executor in the last column): the mean over seeds (the range over seeds), on a shared machine whose "
            "load drifts: read the ranges before any ratio. Peak activation memory at batch 64 in MiB; gCO2 of "
            "evaluating the whole test split.", ""] + carbon_note(records)
    for ds in datasets:
        rs = [r for r in records if r["dataset"] == ds]
        arms_st = (stats.get(ds) or {}).get("arms", {})
        out += [f"### {NAMES.get(ds, ds)}", ""]
        out += ["| arm | seeds | accuracy | heads (k/H) | s_mean | FLOP frac | lat b1 ms | lat b64 ms | "
                "peak MiB b64 | gCO2 (test split) | executor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm in _arms_in_order({r["arm"] for r in rs}):
            a = arms_st.get(arm, {})
            ar = [r for r in rs if r["arm"] == arm]
            mem, g = _mean_of(ar, "peak_inference_memory_b64_bytes"), _mean_of(ar, "inference_gco2")
            gtxt = f"{g:.2g}" if g is not None else "-"
            out.append(f"| {arm} | {len({r['seed'] for r in ar})} | "  # how many seeds, as the summary counts
                       f"{_interval(a.get('accuracy'))} | {_interval(a.get('heads'), '{:.3f}')} | "
                       f"{_interval(a.get('s_mean'), '{:.3f}')} | {_interval(a.get('flop_fraction'), '{:.3f}')} | "
                       + f"{_range(ar, 'latency_b1_s', '{:.2f}', 1000)} | "
                       + f"{_range(ar, 'latency_b64_s', '{:.1f}', 1000)} | "
                       + (f"{mem / 2**20:.1f}" if mem else "-") + f" | {gtxt} | {ar[0].get('latency_executor')} |")
        out += [""]
        comps = (stats.get(ds) or {}).get("comparisons", {})
        asked = {name for _, group in QUESTIONS for name, _ in group}
        other = [c for n, c in comps.items() if n not in asked and not c.get("user_arm")]  # those: questions
        if other:
            from condcomp.experiments.classification.study_page_questions import RULE

            out += ["Other paired comparisons (a - b in points, mean over seeds; the verdict with its evidence):", ""]
            for c in other:
                t = c.get("seed_t") or {}
                out.append(f"- {c['a']} vs {c['b']} (seeds {', '.join(map(str, c['seeds']))}): "
                           f"{100 * t.get('mean', 0.0):+.2f}: {RULE.words(c)}")
            out += [""]
        if plots:
            from condcomp.experiments.classification.plots import plot_pareto

            plot_dir.mkdir(parents=True, exist_ok=True)
            png = plot_dir / f"pareto_{ds}.png"
            if plot_pareto(rs, png, f"{NAMES.get(ds, ds).replace('**', '')}: accuracy vs realised heads"):
                out += [f"![accuracy vs heads, {ds}]({rel(png)})", ""]
    return out


SUMMARY_PARTS = (("budgetformer_vs_fixed_matched", "learned budget vs uniform fixed top-k"),
                 ("fixed_per_layer_vs_fixed_matched", "per-layer counts (fixed) vs uniform"),
                 ("budgetformer_vs_fixed_per_layer", "learned budget vs fixed top-k at its per-layer counts"),
                 ("budgetformer_vs_budgetformer_mode_k", "per-input counts vs each layer's most common (same "
                                                         "model)"))


def summary_section(stats: dict[str, Any], datasets: list[str]) -> list[str]:
    """The one-screen summary: the question, the answer in one table (mean difference, 95 % seed-level t
    interval, the verdict by :class:`.study_page_claims.ClaimRule`) and what the seeds do not exclude."""
    from condcomp.experiments.classification.study_page_questions import RULE, RULE_TEXT

    parts = [(n, w) for n, w in SUMMARY_PARTS
             if any(n in ((stats.get(ds) or {}).get("comparisons") or {}) for ds in datasets)]
    out = ["## Summary", "",
           "**The question.** At the same mean head count, is a learned budget more accurate than fixed top-k, "
           "and does choosing a head count per input (rather than per layer) add anything?", "",
           "**The answer**, in accuracy points (arm a - arm b, mean over seeds [95 % seed-level t interval]). "
           + RULE_TEXT + " The tables below show the within-seed evidence of each cell. \"(heads a vs b)\": the two "
           "arms' mean realised head fractions differ by more than a tenth, so the comparison is not at equal "
           "compute.", ""]
    if not parts:
        return out + ["No paired comparison has numbers yet.", ""]
    out += ["| dataset | seeds | " + " | ".join(w for _, w in parts) + " |", "|---|---|" + "---|" * len(parts)]
    bounds: dict[str, list[str]] = {}
    for ds in datasets:
        comps = (stats.get(ds) or {}).get("comparisons", {})
        cells, seeds = [], set()
        for name, what in parts:
            c = comps.get(name)
            if not c:
                cells.append("-")
                continue
            seeds.add(len(c["seeds"]))
            t = c.get("seed_t") or {}
            ci = f" [{100 * t['lo']:+.2f}, {100 * t['hi']:+.2f}]" if t.get("lo") is not None else ""
            ha, hb = sum(c["heads_a"]) / len(c["heads_a"]), sum(c["heads_b"]) / len(c["heads_b"])
            unmatched = f" (heads {ha:.3f} vs {hb:.3f})" if abs(ha - hb) > 0.1 * max(ha, hb) else ""
            cells.append(f"{100 * t['mean']:+.2f}{ci}: {RULE.label(c)}{unmatched}")
            x = RULE.not_excluded(c)
            if x is not None and not RULE.label(c).startswith("detected"):
                bounds.setdefault(what, []).append(f"{x:.2f} ({NAMES.get(ds, ds).replace('**', '')})")
        name = NAMES.get(ds, ds).replace("**", "")
        out.append(f"| {name} | {', '.join(map(str, sorted(seeds))) or '-'} | " + " | ".join(cells) + " |")
    out += [""]
    if bounds:
        out += ["**Not excluded** (where nothing is detected, the largest difference in points the 95 % interval "
                "still allows, either sign): " + "; ".join(f"{w}: up to {', '.join(b)}" for w, b in bounds.items())
                + ".", ""]
    return out


def difficulty_section(records: list[dict[str, Any]], datasets: list[str], plot_dir: Path, rel: Any,
                        plots: bool) -> list[str]:
    out = ["## Budget vs difficulty", "",
           "Per test example, BudgetFormer's predicted budget s (mean over layers) against two difficulty proxies: "
           "the *standard* model's loss on that example (same seed; an independent model, high = hard) and the "
           "input length in tokens (after truncation to the setup's max_len: where many inputs are longer, as on "
           "IMDB and Yelp, the top length deciles all sit at that cap, and the length proxy says nothing there; "
           "where every input has the same length, as the 64 pixel tokens of digits, there is no length proxy). "
           "Spearman rank correlation (several seeds: mean [range]); the paper claims s rises "
           "with difficulty. s_sd: how much s varies across examples at all.", "",
           "| dataset | seeds | s_sd | Spearman(loss, s) | Spearman(length, s) | Spearman(loss, heads) |",
           "|---|---|---|---|---|---|"]
    series_by_ds: dict[str, dict[str, list[dict[str, float]]]] = {}
    for ds in datasets:
        rs = [r for r in records if r["dataset"] == ds and r["arm"] == "budgetformer" and r.get("difficulty")]
        if not rs:
            continue

        def fmt(vals: list[float | None]) -> str:
            v = [x for x in vals if x is not None]
            if not v:
                return "- (s constant)"
            if len(v) == 1:
                return f"{v[0]:+.3f}"
            return f"{sum(v) / len(v):+.3f} [{min(v):+.3f}, {max(v):+.3f}]"
        d = [r["difficulty"] for r in rs]
        sds = [x["s_sd"] for x in d if x.get("s_sd") is not None]
        out.append(f"| {NAMES.get(ds, ds)} | {','.join(str(r['seed']) for r in rs)} | "
                   + (f"{sum(sds) / len(sds):.4f}" if sds else "-") + " | "
                   f"{fmt([x['loss']['spearman_s'] for x in d])} | "
                   + ("- (one length)" if all(_constant(x["length"]["bins"]) for x in d)
                      else fmt([x["length"]["spearman_s"] for x in d])) + " | "
                   f"{fmt([x['loss']['spearman_heads'] for x in d])} |")
        series_by_ds[ds] = {f"{p}/seed {r['seed']}": r["difficulty"][p]["bins"] for r in rs for p in ("loss", "length")
                            if p == "loss" or not _constant(r["difficulty"][p]["bins"])}
    out += [""]
    if plots:
        from condcomp.experiments.classification.plots import plot_difficulty

        for ds, series in series_by_ds.items():
            png = plot_dir / f"difficulty_{ds}.png"
            if plot_difficulty(series, png, f"{NAMES.get(ds, ds).replace('**', '')}: BudgetFormer's budget by "
                               "difficulty (10 equal-count bins)"):
                out += [f"![budget vs difficulty, {ds}]({rel(png)})", ""]
    return out


def _constant(bins: list[dict[str, float]]) -> bool:
    """A proxy that takes one value on every example (e.g. the length of fixed-size images)."""
    return bool(bins) and bins[0]["x_lo"] == bins[-1]["x_hi"]


def heads_section(records: list[dict[str, Any]], datasets: list[str], plot_dir: Path, rel: Any,
                   plots: bool) -> list[str]:
    out = ["## Which heads", "",
           "Per layer x head: how often each head ran on the test split (BudgetFormer, fixed top-k: share of "
           "examples; MoH: share of real tokens), the first seed's runs: head indices do not correspond across "
           "seeds (each seed learns its own heads), so frequencies are not averaged over seeds. The first MoH heads "
           "are the shared ones (always on). Below: per-layer mean heads (mean over seeds) and, per seed, the "
           "max - min frequency over heads.", ""]
    for ds in datasets:
        freqs: dict[str, list[list[float]]] = {}
        per_seed: dict[str, list[list[list[float]]]] = {}
        for arm in ("budgetformer", "fixed_matched", "moh"):
            rs = sorted((r for r in records if r["dataset"] == ds and r["arm"] == arm and r.get("head_freq")),
                        key=lambda r: r["seed"])
            if not rs:
                continue
            grids = [[r["head_freq"][ly] for ly in sorted(r["head_freq"])] for r in rs]  # (seeds, layers, heads)
            freqs[f"{arm} (seed {rs[0]['seed']})"] = grids[0]
            per_seed[f"{arm} ({len(rs)} seeds)"] = grids
        if not freqs:
            continue
        if plots:
            from condcomp.experiments.classification.plots import plot_head_heatmaps

            plot_dir.mkdir(parents=True, exist_ok=True)
            png = plot_dir / f"heads_{ds}.png"
            if plot_head_heatmaps(freqs, png, f"{NAMES.get(ds, ds).replace('**', '')}: head selection frequency"):
                out += [f"![head selection, {ds}]({rel(png)})", ""]
        for name, grids in per_seed.items():
            layers = range(len(grids[0]))
            mean_heads = [sum(sum(g[ly]) / len(g[ly]) for g in grids) / len(grids) for ly in layers]
            spreads = [max(max(row) for row in g) - min(min(row) for row in g) for g in grids]
            out.append(f"- {ds} {name}: per-layer mean heads " + ", ".join(f"{v:.2f}" for v in mean_heads)
                       + "; max - min frequency over heads per seed " + ", ".join(f"{v:.2f}" for v in spreads))
        out += [""]
    return out

