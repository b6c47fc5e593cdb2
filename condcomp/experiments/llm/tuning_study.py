"""The study behind ``condcomp tune-llm``: data, the dense reference, static pruning's head sets, then every variant
(tune, evaluate, ``metrics.json``), then the summary table. Finished variants are read back, not rerun."""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.experiments.divergence import TrainingDiverged
from condcomp.experiments.llm.data import PackedSplit, packed_split, split_calibration, tokenizer_encoder
from condcomp.experiments.llm.evaluation import agreement, continuation_nll, greedy, perplexity
from condcomp.experiments.llm.head_importance import (
    group_heads,
    group_importance,
    head_gradients,
    head_importance,
    keep_groups,
    warm_start_scores,
)
from condcomp.experiments.llm.objectives import needs_teacher, objective_key, settings_without_unused_options
from condcomp.experiments.llm.tuning import TuneSettings, copy_model, dump_json, make_trainable, tune
from condcomp.experiments.llm.tuning_report import decode_of, decode_setting, plot_ppl_vs_kv, summary_table
from condcomp.experiments.llm.variants import (
    DEFAULT_ORDER,
    VARIANTS,
    MissingFeature,
    apply_variant,
    check_supported,
    num_heads,
    variant_config,
)
from condcomp.experiments.progress import progress_bar
from condcomp.files import read_json_object, read_torch_dict

DECODE_NOTE = "from `condcomp bench decode`; not measured by tune-llm"


def load_data(tokenizer: Any, data_dir: Path, s: TuneSettings) -> tuple[PackedSplit, PackedSplit, PackedSplit]:
    """``(tuning rows, calibration rows, test rows)``."""
    encode, sep = tokenizer_encoder(tokenizer)
    n = len(s.datasets)
    per = -(-s.steps * s.batch_size // n) + s.calib_seqs
    train = packed_split(encode, data_dir, "train", per, s.seq_len, sep, s.seed, s.datasets)
    tuning, calib = split_calibration(train, s.calib_seqs, s.datasets)
    test = packed_split(encode, data_dir, "test", s.eval_seqs, s.seq_len, sep, s.seed, s.datasets)
    return tuning, calib, test


def agreement_prompts(test: PackedSplit, s: TuneSettings) -> Tensor:
    """The first ``agree_prompts`` test rows' prompts (datasets interleaved)."""
    return test.ids[:s.agree_prompts, :s.prompt_len]


def static_head_sets(model: nn.Module, calib: PackedSplit, s: TuneSettings, out: Path) -> dict[str, Any]:
    """Michel et al.'s importance on the calibration rows, per KV group; the kept groups for 1 and 2 of 3."""
    path = out / "static_importance.json"
    if path.is_file():
        saved = read_json_object(path, "tune-llm's static importance", "delete it to compute it again")
        if saved.get("settings") == s.tuning_key():
            return saved  # type: ignore[no-any-return]
    cfg: Any = getattr(model, "config")  # noqa: B009
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    model.eval()

    def loss_fn(m: nn.Module, ids: Tensor) -> Tensor:
        return continuation_nll(m, ids, s.prompt_len).mean(-1)

    batches = list(calib.ids.split(s.batch_size))
    started = time.perf_counter()
    grads = head_gradients(model, batches, loss_fn, H)
    groups = group_importance(grads, G)
    record = {"method": "Michel et al. 2019: mean over calibration sequences of |dL/d xi|, xi a gate on a KV group's "
                        "heads (the sum of its heads' gate derivatives per sequence)",
              "calibration_rows": calib.ids.shape[0], "seconds": time.perf_counter() - started,
              "group_importance": groups.tolist(), "head_importance": head_importance(grads).tolist(),
              "keep": {str(k): keep_groups(groups, k) for k in range(1, G + 1)},
              "heads": {str(k): [group_heads(gs, H, G) for gs in keep_groups(groups, k)] for k in range(1, G + 1)},
              "settings": s.tuning_key()}
    dump_json(path, record)
    return record


def run_variant(name: str, dense: nn.Module, tokenizer: Any, data: tuple[PackedSplit, PackedSplit, PackedSplit],
                s: TuneSettings, out: Path, reference: Tensor, static: dict[str, Any] | None) -> dict[str, Any]:
    """Tune (unless untuned) and evaluate one variant; writes ``out/<name>/metrics.json``."""
    v = VARIANTS[name]
    vdir = out / name
    tuning, _calib, test = data
    torch.manual_seed(s.seed)  # routing and LoRA initialisation
    model = copy_model(dense)
    heads = static["heads"][str(v.static_keep)] if (v.static_keep is not None and static) else None
    warm = warm_start_scores(torch.tensor(static["group_importance"])) if (v.warm_start and static) else None
    apply_variant(model, name, s.executor, heads, warm)
    record: dict[str, Any] = {"variant": name, "note": v.note, "status": "done", "settings": asdict(s),
                              "config": variant_config(name, num_heads(dense)),
                              "static_heads": heads, "kv_fraction_nominal": v.kv_fraction}
    if v.tuned:
        model = make_trainable(model, s)
        record["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        teacher = dense if needs_teacher(s.objective) else None  # the loaded model: never wrapped nor tuned
        state = tune(model, tuning.ids, s, vdir / "checkpoint.pt", desc=f"tune {name}", teacher=teacher)
        hist = state["history"]
        record["tuning"] = {"method": s.tune, "objective": {"objective": s.objective,
                                                            **objective_key(s.objective, s.kl_temperature,
                                                                            s.kl_weight)},
                            "steps": state["step"], "seconds": state["seconds"],
                            "cpu_seconds": state["cpu_seconds"],
                            "tokens_seen": state["step"] * s.batch_size * s.seq_len,
                            "loss_first5": _mean([h["loss"] for h in hist[:5]]),
                            "loss_last5": _mean([h["loss"] for h in hist[-5:]]), "history": hist}
    started = time.perf_counter()
    bar = progress_bar(-(-test.ids.shape[0] // s.batch_size), desc=f"eval {name}")
    record["perplexity"] = perplexity(model, test.ids, test.sources, s.prompt_len, s.batch_size, bar)
    bar.close()
    usage = record["perplexity"].pop("usage")
    record["s_mean"], record["k_frac"] = usage["s_mean"], usage["k_frac"]
    record["plan_variety"] = usage["plan_variety"]  # 0: every request kept the same groups
    record["kv_fraction"] = usage["kv_frac"] if usage["kv_frac"] is not None else v.kv_fraction  # measured
    prompts = agreement_prompts(test, s)
    tokens = greedy(model, prompts, s.agree_tokens, _pad(tokenizer))
    record["agreement"] = {**agreement(tokens, reference), "prompts": prompts.shape[0], "new_tokens": s.agree_tokens}
    record["greedy_tokens"] = tokens.tolist()  # the summary compares them with dense_tuned's too
    record["samples"] = [{"prompt": tokenizer.decode(prompts[i]), "continuation": tokenizer.decode(tokens[i]),
                          "dense": tokenizer.decode(reference[i])} for i in range(min(s.samples, prompts.shape[0]))]
    record["eval_seconds"] = time.perf_counter() - started
    record["decode"] = {"ms_per_token": None, "kv_bytes": None, "note": DECODE_NOTE}
    dump_json(vdir / "metrics.json", record)
    return record


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _pad(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad)


def dense_reference(dense: nn.Module, tokenizer: Any, prompts: Tensor, s: TuneSettings, out: Path) -> Tensor:
    """The untuned dense model's greedy continuations (cached in ``out/dense_greedy.pt``)."""
    path = out / "dense_greedy.pt"
    if path.is_file():
        saved = read_torch_dict(path, "the dense model's greedy continuations", "delete it to compute them again")
        if (isinstance(saved.get("prompts"), Tensor) and isinstance(saved.get("tokens"), Tensor)
                and saved["prompts"].shape == prompts.shape and torch.equal(saved["prompts"], prompts)
                and saved["tokens"].dim() == 2 and saved["tokens"].shape[1] == s.agree_tokens):
            return saved["tokens"]  # type: ignore[no-any-return]
    tokens = greedy(dense, prompts, s.agree_tokens, _pad(tokenizer))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"prompts": prompts, "tokens": tokens}, path)
    return tokens


def run_tuning_study(s: TuneSettings, variants: list[str], out: Path, results: Path | None, data_dir: Path,
              command: str | None = None, loader: Any = None, decode: list[dict[str, Any]] | None = None) -> str:
    """Every variant in order; a variant this condcomp cannot run is recorded as skipped and the study goes on."""
    from condcomp.experiments.llm.smollm2 import load_smollm2

    for name in variants:  # cheap checks first: say now, not after an hour, what will be skipped
        try:
            check_supported(name)
        except MissingFeature as err:
            print(f"tune-llm: will skip {name}: {err}")
    dense, tokenizer = (loader or load_smollm2)()
    data = load_data(tokenizer, data_dir, s)
    prompts = agreement_prompts(data[2], s)
    reference = dense_reference(dense, tokenizer, prompts, s, out)
    static = None
    if any(VARIANTS[v].static_keep is not None or VARIANTS[v].warm_start for v in variants):
        static = static_head_sets(dense, data[1], s, out)
        if results is not None:
            dump_json(results / "static_importance.json", static)
    for name in variants:
        path = out / name / "metrics.json"
        record = json.loads(path.read_text()) if path.is_file() else None
        if record is None or record.get("status") != "done" or not same_settings(record.get("settings"), s):
            try:
                record = run_variant(name, dense, tokenizer, data, s, out, reference, static)
            except MissingFeature as err:
                record = {"variant": name, "status": "skipped", "reason": str(err), "settings": asdict(s)}
            except TrainingDiverged:  # the settings are wrong for every variant: the run stops, no record
                raise
            except Exception as err:  # one broken variant must not cost the others their run
                record = {"variant": name, "status": "failed", "reason": f"{type(err).__name__}: {err}",
                          "traceback": traceback.format_exc(), "settings": asdict(s)}
                print(f"tune-llm: {name} failed: {err}")
            if command:
                record["command"] = command
            dump_json(path, record)
        if results is not None:
            dump_json(results / name / "metrics.json", record)
    folders = [out] + ([results] if results is not None else [])
    return "\n\n".join(dict.fromkeys(write_summary(folder, decode) for folder in folders))


def same_settings(saved: dict[str, Any] | None, s: TuneSettings) -> bool:
    """Whether a metrics.json was written with settings ``s`` (fields at None count as absent, so records written
    before a field existed still match; so do objective options the objective does not use)."""
    def key(d: dict[str, Any]) -> dict[str, Any]:
        return settings_without_unused_options({k: v for k, v in d.items() if v is not None})

    return saved is not None and key(saved) == key(asdict(s) | {"datasets": list(s.datasets)})


def write_summary(folder: Path, decode: list[dict[str, Any]] | None = None) -> str:
    """``summary.md`` / ``summary.json`` (and, with matplotlib, ``ppl_vs_kv.png``) of every variant that has a
    ``metrics.json`` in ``folder``, whichever run wrote it; returns the table. ``decode``: records of
    ``condcomp bench decode`` runs, joined by kept fraction (:func:`decode_of`)."""
    records = [json.loads(p.read_text()) for name in DEFAULT_ORDER if (p := folder / name / "metrics.json").is_file()]
    for r in records:
        if decode and r.get("status") == "done":
            r["decode"] = decode_of(r, decode)
    tuned = next((r for r in records if r["variant"] == "dense_tuned" and r.get("greedy_tokens")), None)
    for r in records:  # agreement with the tuned dense model separates routing from domain adaptation
        if tuned is not None and r.get("greedy_tokens"):
            r["agreement_tuned"] = agreement(torch.tensor(r["greedy_tokens"]), torch.tensor(tuned["greedy_tokens"]))
    table = summary_table(records, decode_setting(decode) if decode else None)
    (folder / "summary.md").write_text(table + "\n")
    dump_json(folder / "summary.json", [_row(r) for r in records])
    plot_ppl_vs_kv(folder, folder / "ppl_vs_kv.png")
    return table


def _row(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("variant", "status", "kv_fraction", "k_frac", "s_mean", "plan_variety", "reason")
    row = {k: r.get(k) for k in keys}
    if r.get("perplexity"):
        row["ppl"] = r["perplexity"]["ppl"]
        row["ppl_per_dataset"] = {d: v["ppl"] for d, v in r["perplexity"]["per_dataset"].items()}
    if r.get("agreement"):
        row["token_agreement"] = r["agreement"]["token_agreement"]
    if r.get("agreement_tuned"):
        row["token_agreement_tuned"] = r["agreement_tuned"]["token_agreement"]
    if r.get("tuning"):
        row["tune_seconds"] = r["tuning"]["seconds"]
    if (r.get("decode") or {}).get("ratio") is not None:
        row["decode"] = r["decode"]
    return row
