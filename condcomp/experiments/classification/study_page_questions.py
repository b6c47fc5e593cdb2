"""The questions section of the results page: paired comparisons with seed-level intervals and the detectable
difference, and the adaptivity measures of the BudgetFormer runs (from summary.json and statistics.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from condcomp.experiments.classification.budget_verdict import PAPER_S, difficulty_target, verdict_section
from condcomp.experiments.classification.study_page_claims import ClaimRule

RULE = ClaimRule()
RULE_TEXT = (f"The verdict: \"detected\" only when the seed-level interval and the within-seed evidence both "
             "exclude 0 in the same direction (\"not established\" when only one does); \"matches\" only when "
             f"an equivalence test (TOST, 90 % seed-level t interval) lies inside +-{100 * RULE.margin:g} point; "
             "otherwise \"no difference detected\" with the largest difference the 95 % interval does not "
             "exclude.")

# (comparison in statistics.json, what its difference answers)
QUESTIONS = (
    ("Does a learned per-layer allocation beat a uniform one?", (
        ("budgetformer_vs_fixed_matched", "BudgetFormer - fixed top-k, the same k in every layer (the head "
         "count nearest to BudgetFormer's mean)"),
        ("fixed_per_layer_vs_fixed_matched", "fixed top-k at BudgetFormer's per-layer head counts - the same, "
         "uniform"),
    )),
    ("Does per-input adaptivity add anything on top?", (
        ("budgetformer_vs_fixed_per_layer", "BudgetFormer - fixed top-k trained at its per-layer mean head "
         "counts (per-layer allocation matched, no per-input variation)"),
        ("budgetformer_vs_budgetformer_mode_k", "BudgetFormer - the same trained model with every example's k "
         "set to its layer's most common k and s to the layer's mean (evaluation only)"),
    )),
    ("Does learned routing beat random routing, both trained?", (
        ("fixed_per_layer_vs_random_routing", "top-k scorer - random heads, both trained at BudgetFormer's "
         "per-layer head counts"),
    )),
)


def _pts(v: float | None, sign: bool = True) -> str:
    return "-" if v is None else (f"{100 * v:+.2f}" if sign else f"{100 * v:.2f}")


def _heads(vals: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in vals)


def comparison_row(label: str, comp: dict[str, Any]) -> str:
    """One table row: seeds, per-seed heads of both arms, the seed-level difference and interval, the
    within-seed example bootstrap, the detectable difference, the seeds a 1-point one needs, the verdict."""
    t = comp.get("seed_t") or {}
    ci = f"[{_pts(t.get('lo'))}, {_pts(t.get('hi'))}]" if t.get("lo") is not None else "(one seed)"
    b = comp.get("bootstrap")
    boot = "-"
    if b:
        boot = f"[{_pts(b['lo'])}, {_pts(b['hi'])}]" + ("" if b.get("resampled") == "examples" else " (s+e)")
    need = t.get("seeds_for_1pt")
    return (f"| {label} | {', '.join(map(str, comp['seeds']))} | {_heads(comp['heads_a'])} | "
            f"{_heads(comp['heads_b'])} | {_pts(t.get('mean'))} {ci} | {boot} | {_pts(t.get('mdd_80'), False)} | "
            f"{need if need is not None else '-'} | {RULE.words(comp)} |")


def questions_section(stats: dict[str, Any], datasets: list[str], names: dict[str, str],
                      records: list[dict[str, Any]] | None = None) -> list[str]:
    kept = any((c.get("bootstrap") or {}).get("resampled") == "seeds and examples"
               for ds in datasets for c in ((stats.get(ds) or {}).get("comparisons") or {}).values())
    out = ["## The questions, per dataset", "",
           "Each row: arm a - arm b in accuracy points, mean over the seeds both arms have. The interval is the "
           "seed-level paired Student t (df = seeds - 1): the seed carries the training noise. Beside it, the "
           "within-seed part: a 95 % bootstrap over the test examples with every seed kept"
           + (" (\"(s+e)\": seeds resampled too, kept from an earlier statistics.json whose run folders are gone; "
              "that computation reused one example resample for a seed drawn twice, so these intervals are wider, "
              "in expectation, than the two-stage bootstrap's)" if kept else "")
           + " (\"-\": the per-example predictions are not kept; the verdict then uses the exact McNemar test "
           "pooled over seeds where its counts are kept). MDD: the smallest true difference the seed-level test "
           "detects with 80 % power at the observed seed-to-seed spread; then the seeds a 1-point MDD would "
           "need. Heads: the realised fraction of heads of arm a and arm b in each seed. " + RULE_TEXT, ""]
    for question, comps in QUESTIONS:
        out += [f"### {question}", ""]
        for name, what in comps:
            rows = [(ds, (stats.get(ds) or {}).get("comparisons", {}).get(name)) for ds in datasets]
            rows = [(ds, c) for ds, c in rows if c]
            out += [f"**{what}.**", ""]
            if not rows:
                out += ["Not run yet.", ""]
                continue
            out += ["| dataset | seeds | heads a | heads b | a - b (pts) [95 % seed t] | within-seed bootstrap | "
                    "MDD 80 % (pts) | seeds for 1 pt | verdict |", "|---|---|---|---|---|---|---|---|---|"]
            out += [comparison_row(names.get(ds, ds), c) for ds, c in rows]
            out += [""]
        if question.startswith("Does per-input adaptivity"):
            out += training_not_inference(stats, datasets, names, records)
    return out + user_arms_section(stats, datasets, names)


def user_arms_section(stats: dict[str, Any], datasets: list[str], names: dict[str, str]) -> list[str]:
    """Your components (``--router-arms`` / ``--policy-arms``) against the built-in arm that differs only in
    that component, in the questions' table; nothing when the study has none."""
    rows = [(ds, c) for ds in datasets for c in ((stats.get(ds) or {}).get("comparisons") or {}).values()
            if c.get("user_arm")]
    if not rows:
        return []
    return ["### Does your component beat the built-in one?", "",
            "`router_<key>`: your router choosing the heads at `fixed_matched`'s budget, against the topk scorer "
            "there (only the router differs); `policy_<key>`: your budget policy with BudgetFormer's topk scorer, "
            "against `budgetformer` (only the policy differs).", "",
            "| dataset: a - b | seeds | heads a | heads b | a - b (pts) [95 % seed t] | within-seed bootstrap | "
            "MDD 80 % (pts) | seeds for 1 pt | verdict |", "|---|---|---|---|---|---|---|---|---|",
            *(comparison_row(f"{names.get(ds, ds)}: {c['a']} - {c['b']}", c) for ds, c in rows), ""]


def router_options(records: list[dict[str, Any]], ds: str, arm: str) -> dict[str, Any]:
    """The router options an arm of ``ds`` trained with (the records' ``method_options``; {} = the defaults)."""
    for r in records:
        if r["dataset"] == ds and r["arm"] == arm:
            return dict((r.get("method_options") or {}).get("router_options") or {})
    return {}


def training_not_inference(stats: dict[str, Any], datasets: list[str], names: dict[str, str],
                           records: list[dict[str, Any]] | None = None) -> list[str]:
    """Where BudgetFormer's lead over fixed top-k trained at its per-layer counts is detected (both kinds of
    evidence) while its own model at each layer's most common count shows no difference, the gain is not per-input
    choice at inference. What in training causes it is named only when the two arms trained alike but the budget:
    where their router options differ (``records``), the comparison is confounded and the page says so."""
    out = []
    for ds in datasets:
        comps = (stats.get(ds) or {}).get("comparisons", {})
        trained, mode = comps.get("budgetformer_vs_fixed_per_layer"), comps.get("budgetformer_vs_budgetformer_mode_k")
        if not trained or not mode:
            continue
        t, m = trained.get("seed_t") or {}, mode.get("seed_t") or {}
        if t.get("lo") is None or m.get("lo") is None or not m["lo"] <= 0 <= m["hi"]:
            continue
        gain = RULE.words(trained)
        if not gain.startswith("detected"):
            if t["lo"] > 0:
                out.append(f"{names.get(ds, ds)}: BudgetFormer's lead over fixed top-k trained at its per-layer "
                           f"counts ({_pts(t['mean'])} points) is {gain}.")
            continue
        line = (f"{names.get(ds, ds)}: BudgetFormer beats fixed top-k trained at its per-layer counts "
                f"({_pts(t['mean'])} points, {gain}), but the same model with every example at its layer's most "
                f"common count shows no difference ({_pts(m['mean'])} [{_pts(m['lo'])}, {_pts(m['hi'])}]): the "
                "gain is not from choosing a count per input at inference.")
        bf, fl = router_options(records or [], ds, "budgetformer"), router_options(records or [], ds, "fixed_per_layer")
        if records is not None and bf != fl:
            line += (f" Its cause in training is not identified: BudgetFormer's router trained with "
                     f"`{json.dumps(bf, sort_keys=True)}`, fixed top-k's with `{json.dumps(fl, sort_keys=True)}` "
                     "(the records' method_options), so the two arms differ in more than the budget.")
        elif records is not None:
            line += " Both arms trained with the same router options: the difference is in how the budget was trained."
        out.append(line)
    return out + [""] if out else []


def adaptivity_section(records: list[dict[str, Any]], datasets: list[str], names: dict[str, str],
                       plot_dir: Path, rel: Any, plots: bool) -> list[str]:
    out = ["## How much the learned budget adapts to the input", "",
           "Per BudgetFormer run (test split): the spread of the budget s over examples (sd), per layer the mean "
           "head count, the share of examples whose head count differs from the layer's most common one "
           "(k off mode: 0 = a per-layer constant) and the entropy of the head *set* over examples (0 bits = "
           "every example runs the same heads), and Spearman's rank correlation of s with the standard model's "
           "loss on the same example (same seed; positive = harder inputs get more heads). One line per seed.",
           ""]
    rows = [r for r in records if r["arm"] == "budgetformer" and r.get("adaptivity")]
    if not rows:
        return out + ["No run records these measures yet.", ""]
    out += ["| dataset | seed | s_mean | s sd | per layer: mean k (k off mode; set entropy bits) | "
            "k off mode, any layer | Spearman(difficulty, s) |", "|---|---|---|---|---|---|---|"]
    for ds in datasets:
        for r in sorted((r for r in rows if r["dataset"] == ds), key=lambda r: r["seed"]):
            a = r["adaptivity"]
            layers = "; ".join(f"{v['k_mean']:.2f} ({100 * v['k_off_mode']:.1f} %; "
                               f"{v.get('set_entropy_bits', float('nan')):.2f})"
                               for _, v in sorted(a["layers"].items()))
            rho = a.get("spearman_difficulty_s")
            if rho is None:  # the standard run's folder is gone: the same correlation from the difficulty record
                rho = ((r.get("difficulty") or {}).get("loss") or {}).get("spearman_s")
            out.append(f"| {names.get(ds, ds)} | {r['seed']} | {r['s_mean']:.3f} | {a['s_sd']:.3f} | {layers} | "
                       f"{100 * a['k_off_mode_any']:.1f} % | " + (f"{rho:+.3f}" if rho is not None else "-") + " |")
    out += [""]
    if plots:
        from condcomp.experiments.classification.plots import plot_adaptivity

        plot_dir.mkdir(parents=True, exist_ok=True)

        for ds in datasets:
            rs = sorted((r for r in rows if r["dataset"] == ds), key=lambda r: r["seed"])
            if not rs:
                continue
            png = plot_dir / f"adaptivity_{ds}.png"
            if plot_adaptivity(rs, png, f"{names.get(ds, ds).replace('**', '')}: per-example head counts and "
                               "budget (BudgetFormer)"):
                out += [f"![adaptivity, {ds}]({rel(png)})", ""]
    return out


def regime_section(records: list[dict[str, Any]], datasets: list[str], names: dict[str, str],
                   search: dict[str, Any] | None) -> list[str]:
    """The paper's budget regime: BudgetFormer with and without a price on heads (full-length study runs), and
    the short search runs of ``results/budget_search`` when present."""
    target = difficulty_target(records) > 0
    out = ["## Can the learned budget reach the paper's regime and still vary per input?", "",
           "The goal: s_mean within 0.1 of the paper's, accuracy within 1 point of the standard model, a head "
           "count off the layer's most common one on at least 25 % of test examples, and a positive correlation "
           "with difficulty in every seed. Study runs (full length): BudgetFormer "
           + ("trained with the difficulty target (`--budget-target`)" if target else "with the paper's loss")
           + " and with a price c * mean(s) on heads (`budgetformer_cost<c>`). Per-layer mean heads of exactly "
           "1.00 mean every example runs one head (the floor k_min = 1): no per-input variation is possible there.", "",
           "| dataset | arm | seed | s_mean (paper) | acc - standard (pts) | mean heads per layer | s sd | "
           "Spearman(difficulty, s) |", "|---|---|---|---|---|---|---|---|"]
    std = {(r["dataset"], r["seed"]): r["accuracy"] for r in records if r["arm"] == "standard"}
    for ds in datasets:
        rs = [r for r in records if r["dataset"] == ds and (r["arm"] == "budgetformer"
                                                             or r["arm"].startswith("budgetformer_cost"))]
        for r in sorted(rs, key=lambda r: (r["arm"], r["seed"])):
            H = (r.get("model") or {}).get("num_heads") or 8
            heads = ", ".join(f"{H * v:.2f}" for _, v in sorted((r.get("layers") or {}).items()))
            d = r.get("difficulty") or {}
            rho = (d.get("loss") or {}).get("spearman_s")
            gap = r["accuracy"] - std[(ds, r["seed"])] if (ds, r["seed"]) in std else None
            paper = f" ({PAPER_S[ds]:.3f})" if ds in PAPER_S else ""
            out.append(f"| {names.get(ds, ds)} | {r['arm']} | {r['seed']} | {r['s_mean']:.3f}{paper} | "
                       + (f"{100 * gap:+.2f}" if gap is not None else "-") + f" | {heads} | "
                       + (f"{d['s_sd']:.3f}" if d.get("s_sd") is not None else "-") + " | "
                       + (f"{rho:+.3f}" if rho is not None else "-") + " |")
    out += [""]
    if search:
        out += search_lines(search)
    return out + verdict_section(records, search, names)


def search_lines(search: dict[str, Any]) -> list[str]:
    """The short search runs (``results/budget_search/search.json``, from its ``collect.py``)."""
    out = ["Short search runs (`results/budget_search/run_search.sh`, then `collect.py`): unless the table says "
           f"otherwise AG News, the `small` model, seed 0, {search.get('steps', '?')} steps, inputs truncated to "
           f"{search.get('max_len', '?')} tokens, the same {search.get('n_test', '?')} test examples; difficulty "
           "= the loss of a standard `small` model trained the same way on the same dataset at seed 0; the "
           "accuracy reference = that model, or a standard model of the run's own size and steps where one was "
           "trained (standard runs' accuracy: "
           + (", ".join(f"{n} {r['accuracy']:.4f}" for n, r in search["runs"].items() if r.get("method") == "standard")
              or "-")
           + "). One seed per run: a screen, not a test.", "",
           "| run | dataset, model, seed, steps | settings | accuracy - standard (pts) | s_mean | s sd | "
           "per layer: mean k (k off mode) | k off mode, any layer | Spearman(difficulty, s) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, r in search["runs"].items():
        a = r.get("adaptivity")
        if a is None:
            continue
        opts = json.dumps(r["method_options"]) + (f", budget cost {r['budget_cost']:g}" if r["budget_cost"] else "")
        opts += f", difficulty target {r['budget_target']:g}" if r.get("budget_target") else ""
        ref = r.get("standard_accuracy", search.get("standard_accuracy"))
        gap = r["accuracy"] - ref if ref is not None else None
        where = f"{r.get('dataset', 'ag_news')}, {r.get('preset', 'small')}, {r.get('seed', 0)}, {r.get('steps')}"
        layers = "; ".join(f"{v['k_mean']:.2f} ({100 * v['k_off_mode']:.1f} %)" for _, v in sorted(a["layers"].items()))
        rho = a.get("spearman_difficulty_s")
        out.append(f"| {name} | {where} | `{opts}` | " + (f"{100 * gap:+.2f}" if gap is not None else "-")
                   + f" | {r['s_mean']:.3f} | {a['s_sd']:.3f} | {layers} | {100 * a['k_off_mode_any']:.1f} % | "
                   + (f"{rho:+.3f}" if rho is not None else "-") + " |")
    out += [""]
    if search.get("gradients"):
        out += ["What pulls on the budget, per example (`results/budget_search/gradients.py`): the task loss's "
                "gradient with respect to each example's s in training mode, as a pull -dL_i/ds_i (> 0: towards "
                "more heads), on the first test examples, by quintile of difficulty (the standard model's loss; "
                "easiest first). The paper's loss adds nothing per input (the hinge is 0 inside its interval, a "
                "price on heads is the same for every example), so this pull is the only signal that can make s "
                "differ between inputs.", "",
                "| model | layer | examples | share pulling towards more heads | mean pull by difficulty quintile "
                "(easiest .. hardest) | Spearman(difficulty, s) |", "|---|---|---|---|---|---|"]
        for name, g in search["gradients"].items():
            policy = (g.get("method_options") or {}).get("policy")
            if policy and policy[0] == "budgetformer_signed":
                name += " (pull after the sign transform: what its budget network receives)"
            for layer, v in sorted(g["layers"].items()):
                q = ", ".join(f"{x:+.3f}" for x in v.get("pull_by_difficulty_quintile", []))
                rho = v.get("spearman_difficulty_s")
                out.append(f"| {name} | {layer} | {v['n']} | {100 * v['towards_more_heads']:.0f} % | {q} | "
                           + (f"{rho:+.3f}" if rho is not None else "-") + " |")
        out += [""]
    return out
