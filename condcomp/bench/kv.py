"""``condcomp bench kv``: quality per KV-cache byte on long prompts, every variant side by side in one run.

For each prompt length, every variant (:mod:`condcomp.bench.kv_variants`: dense, transformers' quantized caches,
condcomp's compact caches keeping some KV groups, their compositions) is measured on the same cases
(:mod:`condcomp.bench.kv_cases`, built from the local corpora):

- ``ppl``: perplexity of continuation tokens teacher-forced *through the cache*: the prompt is prefilled into the
  variant's cache, then the continuation is fed on that cache, so every scored prediction reads the compressed
  prompt;
- ``retrieval_acc`` / ``retrieval_correct`` (per case, the same cases in the same order for every variant):
  exact-match retrieval (:mod:`condcomp.bench.kv_cases`: the facts task, or the passkey task), greedy answers
  decoded on the variant's cache; where the question follows the context it is fed through that cache too;
- ``token_nll``: the per-token NLLs behind ``ppl`` (one list per continuation window), for paired tests;
- ``kv_bytes`` / ``kv_frac``: the bytes of the tensors the variant's cache holds after the retrieval prefill
  (quantized tensors, scales and zero points included), over the dense cache's;
- ``decode_ms_per_token``: greedy decode steps on a random prompt, all variants interleaved step by step (medians;
  ``decode_ratio``: step-paired ratio to dense), as ``condcomp bench decode`` times them.

Results: ``records/<variant>@<prompt>.json`` (read back on a rerun with the same settings instead of measured
again), then ``metrics.json``, ``summary.md``, ``samples.json`` and ``quality_vs_kv.png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from condcomp.bench import kv_press, kv_report, kv_user
from condcomp.bench.decode import device_clock
from condcomp.bench.kv_cases import RetrievalCase, continuation_cases, haystack_stream
from condcomp.bench.kv_presets import (
    CORPORA,
    PASSKEY_FORMATS,
    PRESET_HELP,
    PRESETS,
    Preset,
    add_task_arguments,
    encoder,
    load,
    passkey_format,
    separator_ids,
    with_overrides,
)
from condcomp.bench.kv_quotes import answer_check, task_cases
from condcomp.bench.kv_text import add_text_arguments, choose_texts, staged_texts
from condcomp.bench.kv_variants import (
    MODELS,
    VARIANTS,
    KVVariant,
    ModelContext,
    cache_bytes,
    cache_from_prefill,
    check_names,
    computed_importance,
    missing_packages,
    quantized_cache,
)
from condcomp.cli_args import integer, output_folder
from condcomp.experiments.llm.importance_file import importance_file
from condcomp.experiments.progress import progress_bar
from condcomp.kv.continuation import prompt_plans
from condcomp.kv.importance import saved_importance

kv_press.register(VARIANTS, MODELS, KVVariant)  # kvpress's presses beside condcomp's variants (optional extra)


def record_path(out: Path, variant: str, prompt: int | str) -> Path:
    return out / "records" / f"{variant}@{prompt}.json"


def read_record(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """A finished record measured with the same ``settings``, else None (missing, unreadable or other settings)."""
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("settings") == settings else None


def write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # a run stopped mid-write leaves no half record behind


class Bench:
    """The loaded model, the prepared variant models (one per :data:`MODELS` key, made on first use) and caches."""

    def __init__(self, dense: nn.Module, device: torch.device, importance: Any) -> None:
        self.dense, self.device = dense, device
        self.ctx = ModelContext(importance=importance)
        self.models: dict[str, nn.Module] = {}
        self.config: Any = getattr(dense, "config")  # noqa: B009
        self.pressed: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}  # eviction presses' caches from the last prefill
        self.seen = 0

    def model(self, key: str) -> nn.Module:
        if key not in self.models:
            self.models[key] = MODELS[key](self.dense, self.ctx).to(self.device).eval()
        return self.models[key]

    def prefill(self, key: str, ids: Tensor, group: list[str] | None = None) -> tuple[Tensor, Any]:
        """``(last logits (B, V), dynamic cache)`` of the model ``key`` on ``ids``; a head-wise kvpress variant's
        press masks during it, and the eviction presses of ``group`` capture their caches from it."""
        model = self.model(key)
        with kv_press.prefill_context(key, model, ids.shape[1], group or []) as self.pressed, prompt_plans(
                model, ids.shape[1]):  # the whole prompt: what follows may come in one call (snapkv, adakv)
            out = model(input_ids=ids.to(self.device), use_cache=True, logits_to_keep=1)
        if key in kv_press.PRESS_VARIANTS:
            kv_press.mark_seen(out.cache, ids.shape[1])  # the cache may hold fewer tokens than it has seen
        self.seen = ids.shape[1]
        return out.logits[:, -1], out.cache

    def step(self, variant: str, ids: Tensor, cache: Any) -> tuple[Tensor, Any]:
        """Feed ``ids (B, T)`` on ``cache``: ``(logits (B, T, V), cache)``."""
        extra = {}
        if (positions := kv_press.true_positions(cache, ids.shape[1])) is not None:  # after a press's eviction
            extra["position_ids"] = positions.to(self.device)
        out = self.model(VARIANTS[variant].model)(input_ids=ids.to(self.device), cache=cache, use_cache=True,
                                                  **extra)
        return out.logits, out.cache

    def cache_for(self, variant: str, source: Any) -> Any:  # source: the last prefill's cache
        if variant in self.pressed:
            return kv_press.cache_from_captured(self.pressed[variant], self.config, self.seen)
        return cache_from_prefill(source, VARIANTS[variant].cache, self.config)


def by_model(names: list[str]) -> dict[str, list[str]]:
    """Variants grouped by the model that fills their cache (one prefill per group)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(VARIANTS[name].model, []).append(name)
    return groups


@torch.inference_mode()
def measure_length(bench: Bench, names: list[str], cont: list[list[int]], keys: list[RetrievalCase], p: Preset,
                   decode_text: Any, bar: Any) -> dict[str, dict[str, Any]]:
    """Every variant of ``names`` on one prompt length's continuation and retrieval cases."""
    res: dict[str, dict[str, Any]] = {n: {"nll_sum": 0.0, "tokens": 0, "token_nll": [], "hits": [], "by_depth": {},
                                          "samples": [], "kv_bytes": None} for n in names}
    P = len(cont[0]) - p.cont_len - 1 if cont else 0  # the prompt length (a question-aware case adds its question)
    for start in range(0, len(cont), p.batch):
        ids = torch.tensor(cont[start:start + p.batch])  # (b, P + C + 1)
        for key, group in by_model(names).items():
            _, source = bench.prefill(key, ids[:, :P], group)
            for name in group:
                logits, _ = bench.step(name, ids[:, P:-1], bench.cache_for(name, source))  # (b, C, V)
                nll = F.cross_entropy(logits.float().transpose(1, 2), ids[:, P + 1:].to(logits.device),
                                      reduction="none")  # (b, C)
                res[name]["nll_sum"] += float(nll.sum())
                res[name]["tokens"] += nll.numel()
                res[name]["token_nll"] += [[round(x, 5) for x in row] for row in nll.tolist()]  # paired per token
            bar.update(1)
    correct = answer_check(p.task)
    for start in range(0, len(keys), p.batch):
        cases = keys[start:start + p.batch]
        ids = torch.tensor([c.ids for c in cases])  # (b, P)
        question = torch.tensor([c.question for c in cases])  # (b, Q); Q = 0 when the question is in the context
        for key, group in by_model(names).items():
            last, source = bench.prefill(key, ids, group)
            for name in group:
                cache = bench.cache_for(name, source)
                if res[name]["kv_bytes"] is None:
                    res[name]["kv_bytes"] = cache_bytes(cache)  # after the prefill of the first retrieval batch
                first = last
                if question.shape[1]:  # asked after the context: the question reads the compressed cache
                    logits, cache = bench.step(name, question, cache)  # (b, Q, V)
                    first = logits[:, -1]
                token = first.argmax(-1, keepdim=True)  # (b, 1)
                answer = [token]
                for _ in range(p.answer_tokens - 1):
                    logits, cache = bench.step(name, token, cache)
                    token = logits[:, -1].argmax(-1, keepdim=True)
                    answer.append(token)
                for case, row in zip(cases, torch.cat(answer, 1).tolist()):
                    text = decode_text(row)
                    ok = correct(text, case.key)
                    r = res[name]
                    r["hits"].append(bool(ok))  # per case, in case order: paired comparisons between variants
                    depth = str(round(case.depth, 1))
                    hits, n = r["by_depth"].get(depth, (0, 0))
                    r["by_depth"][depth] = (hits + ok, n + 1)
                    if len(r["samples"]) < 4:
                        r["samples"].append({"key": case.key, "depth": case.depth, "answer": text, "correct": ok})
            bar.update(1)
    return res


@torch.inference_mode()
def time_decode(bench: Bench, names: list[str], p: Preset, vocab: int) -> dict[str, dict[str, Any]]:
    """Decode ms/token of every variant on one random prompt, steps interleaved and rotated as ``bench decode``."""
    g = torch.Generator().manual_seed(p.decode_prompt * 31 + p.decode_batch)
    prompt = torch.randint(0, vocab, (p.decode_batch, p.decode_prompt), generator=g)
    state: dict[str, dict[str, Any]] = {}
    for key, group in by_model(names).items():
        last, source = bench.prefill(key, prompt, group)
        for name in group:
            state[name] = {"cache": bench.cache_for(name, source), "token": last.argmax(-1, keepdim=True), "s": []}
    for i in range(p.decode_tokens):
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotated: no variant always runs after another
            st = state[name]
            t0 = device_clock(bench.device)
            logits, st["cache"] = bench.step(name, st["token"], st["cache"])
            st["s"].append(device_clock(bench.device) - t0)
            st["token"] = logits[:, -1].argmax(-1, keepdim=True)
    base = state["dense"]["s"]
    return {name: {"decode_ms_per_token": 1e3 * statistics.median(st["s"]),
                   "decode_ratio": statistics.median(s / d for s, d in zip(st["s"], base)),
                   "decode_kv_bytes": cache_bytes(st["cache"])} for name, st in state.items()}


def probe_composition(bench: Bench, name: str, vocab: int) -> str | None:
    """Prefill a short prompt with variant ``name``'s model straight into its quantized cache and decode a step;
    the failure, if any, as a sentence naming where it failed (else None)."""
    import traceback

    v = VARIANTS[name]
    if v.cache is None or v.model == "dense":
        return None
    # 2 x 32: HQQ quantizes a tensor in groups of 64 values, also the (B, 1, T, 1) length placeholder of a
    # layer whose groups are all windowed
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0)).to(bench.device)
    try:
        with torch.inference_mode():
            model = bench.model(v.model)
            out = model(input_ids=ids, cache=quantized_cache(v.cache, bench.config), use_cache=True)
            model(input_ids=ids[:, :1], cache=out.cache, use_cache=True)
    except Exception as err:  # noqa: BLE001  (any failure is the finding, recorded as the skip reason)
        frame = traceback.extract_tb(err.__traceback__)[-1]
        return (f"{name}: a compact cache inside a QuantizedCache fails: {type(err).__name__}: {err} "
                f"(at {Path(frame.filename).name}:{frame.lineno}, {frame.name})")
    return None


def run(model_name: str, out: Path, preset: Preset, names: list[str], device: str = "cpu", threads: int = 2,
        seed: int = 0, data_dir: str | None = None, texts: list[str] | None = None,
        importance_file: Path | None = None, timed: list[str] | None = None, text_source: str | None = None
        ) -> dict[str, Any]:
    """Measure ``names`` (dense always) at the preset's lengths; time decode for ``timed`` (None: every variant,
    ``[]``: none; dense is timed with any other, as the ratios' base). Finished records in ``out`` are reused.
    ``texts``: the haystack documents (None: the staged corpora of ``data_dir``); ``text_source``: their label in
    the records (:func:`condcomp.bench.kv_text.choose_texts`'s), so that records of other text are not reused."""
    names, timed = kv_user.add_user_variants(names, timed)  # module:Name / file.py:Name specs: a user's KV policy
    check_names(names, timed)
    names = ["dense", *[n for n in dict.fromkeys(names) if n != "dense"]]
    skipped = {n: reason for n in names if (reason := missing_packages(n) or (
        kv_press.missing(n) if n in kv_press.PRESS_VARIANTS else None))}
    for reason in skipped.values():
        print(f"skipped: {reason}")
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this torch build sees no CUDA device")
    dense, tok, sep, prefix = load(model_name)
    dense = dense.to(dev).eval()
    encode, sep_ids = encoder(tok), separator_ids(preset, sep, tok)
    fmt = passkey_format(preset.passkey_format, tok) if preset.task == "passkey" else None
    cfg: Any = dense.config
    if texts is None:
        texts = staged_texts(data_dir, CORPORA, seed)

    def stream_for(prompt_len: int) -> list[int]:
        # The haystack of one prompt length depends on that length alone: cases drawn at 2048 are the same whether
        # or not the run also measures 4096 (so records written by a run of other lengths are the same cases)
        return haystack_stream(texts, encode, sep_ids, min_tokens=max(4 * (prompt_len + preset.cont_len + 1), 1024))

    stream = stream_for(min(preset.prompts))

    @functools.cache
    def importance() -> Tensor:
        saved = saved_importance(importance_file, cfg.num_hidden_layers, cfg.num_key_value_heads) if (
            importance_file) else None
        if saved is not None:
            return saved
        calib = torch.tensor([stream[i * 256:(i + 1) * 256] for i in range(4)])  # (4, 256)
        print("computing the static split's group importance on 4 haystack windows of 256 tokens")
        with torch.inference_mode(False), torch.enable_grad():  # gradients, also when asked under inference mode
            return computed_importance(dense, calib.to(dev), prompt_len=64)

    bench = Bench(dense, dev, importance)
    for name in [n for n in names if n not in skipped]:
        if (reason := probe_composition(bench, name, int(cfg.vocab_size))) is not None:
            print(f"skipped: {reason}")
            skipped[name] = reason
    runnable = [n for n in names if n not in skipped]
    base = {"model": model_name, "seed": seed, "batch": preset.batch, "answer_tokens": preset.answer_tokens,
            "passkey_format": preset.passkey_format}
    # keys only where they differ from what every earlier record measured (the passkey task on the staged
    # corpora), so that those records are still read back
    if text_source not in (None, "staged"):
        base["text"] = text_source
    base.update(preset.task_settings())
    settings = {P: {**base, "prompt_len": P, "passkey_cases": preset.cases(P)[0], "ppl_cases": preset.cases(P)[1],
                    "cont_len": preset.cont_len} for P in preset.prompts}
    timing = {**base, "decode_prompt": preset.decode_prompt, "decode_batch": preset.decode_batch,
              "decode_tokens": preset.decode_tokens}
    pending = {P: [n for n in runnable if read_record(record_path(out, n, P), settings[P]) is None]
               for P in preset.prompts}
    # dense is the kv_frac reference: read back when finished, else measured with the others
    dense_done = {P: read_record(record_path(out, "dense", P), settings[P]) for P in preset.prompts}
    pending = {P: (["dense", *[n for n in ns if n != "dense"]] if ns and dense_done[P] is None else ns)
               for P, ns in pending.items()}
    timed = runnable if timed is None else [n for n in runnable if n in timed or (n == "dense" and timed)]
    time_pending = any(read_record(record_path(out, n, "decode"), timing) is None for n in timed)
    groups = {P: len(by_model(ns)) for P, ns in pending.items()}
    total = sum(g * (math.ceil(preset.cases(P)[0] / preset.batch) + math.ceil(preset.cases(P)[1] / preset.batch))
                for P, g in groups.items()) + int(time_pending)
    bar = progress_bar(total=max(total, 1), desc="bench kv")
    for P, todo in pending.items():
        if not todo:
            continue
        n_passkey, n_ppl = preset.cases(P)
        haystack = stream_for(P)
        cont = continuation_cases(haystack, P, preset.cont_len, n_ppl, seed)
        keys = task_cases(preset.task, haystack, encode, tok.decode, P, n_passkey, seed, prefix, fmt, sep_ids,
                          preset.facts, preset.question_in_context, preset.question_form, preset.question_aware)
        res = measure_length(bench, todo, cont, keys, preset, tok.decode, bar)
        dense_ref = res["dense"] if "dense" in res else dense_done[P]
        assert dense_ref is not None  # measured now unless read back
        for name, r in res.items():
            record = kv_report.length_record(name, P, r, dense_ref, settings[P])
            record["nominal_frac"] = kv_press.nominal_fraction(name, bench.dense, P)  # head-wise presses mask
            write_record(record_path(out, name, P), record)
    if time_pending:
        for name, r in time_decode(bench, timed, preset, int(cfg.vocab_size)).items():
            write_record(record_path(out, name, "decode"), {"variant": name, **r, "settings": timing})
        bar.update(1)
    bar.close()
    records = [kv_report.merged(read_record(record_path(out, n, P), settings[P]),
                                read_record(record_path(out, n, "decode"), timing)) for P in preset.prompts
               for n in runnable]
    return {"benchmark": "kv", "preset": asdict(preset), "device": dev.type, "threads": threads,
            "text": text_source or "staged",
            "records": records, "skipped": skipped}


def main(args: argparse.Namespace) -> int:
    out = output_folder(args.out)
    out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[args.preset]
    if args.prompts:
        preset = preset.at_lengths(tuple(args.prompts))
    preset = with_overrides(preset, args)
    if args.passkey_cases:
        counts = tuple(args.passkey_cases)
        preset = replace(preset, passkey_cases=counts[0] if len(counts) == 1 else counts)
    texts, source = choose_texts(args.text_file, args.text_dir, args.hf_dataset, args.data_dir, args.seed,
                                 args.builtin_text, args.corpora)
    result = run(args.model, out, preset, args.variants, args.device, args.threads, args.seed, args.data_dir,
                 texts=texts, importance_file=args.importance, timed=args.time_decode, text_source=source)
    kv_report.write(out, result)
    print(kv_report.table(result["records"]))
    return 0


def add_bench_commands(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("kv", help="quality per KV-cache byte on long prompts: quantized caches, "
                                    "condcomp's compact caches and dense, side by side",
                                    description="Continuation perplexity through the cache, retrieval of facts, "
                                                "measured cache bytes and decode ms/token of every variant; writes "
                                                "metrics.json, summary.md, samples.json and a plot (docs/kv.md).")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny-llama"),
                   help="smollm2 (needs the llm extra, docs/llm.md) or tiny-llama (random, no download)")
    p.add_argument("--out", type=output_folder, required=True, help="results folder (finished records are reused)")
    p.add_argument("--preset", default="cpu", choices=tuple(PRESETS), help=PRESET_HELP)
    p.add_argument("--prompts", type=integer(at_least=1), nargs="+", default=None,
                   help="other prompt lengths (a length the preset measures keeps its case counts; a new one takes "
                        "those of its longest length)")
    add_task_arguments(p)
    p.add_argument("--passkey-format", default=None, choices=PASSKEY_FORMATS,
                   help="override the preset's passkey prompt: chat (the instruct template) or raw (plain text)")
    p.add_argument("--time-decode", nargs="*", default=None, metavar="NAME",
                   help="time decode only for these variants (dense too); given without names: time none; "
                        "default: every variant. On a quiet machine only (the timings are medians of steps)")
    p.add_argument("--decode-prompt", type=integer(at_least=1), default=None,
                   help="override the preset's decode-timing prompt")
    p.add_argument("--decode-batch", type=integer(at_least=1), default=None,
                   help="override the preset's decode-timing batch")
    kv_user.add_variants_argument(p)  # --variants: the built-in names, kvpress's and a user's module:Class
    p.add_argument("--importance", type=importance_file, default=Path("results/llm/static_importance.json"),
                   help="static pruning's group importance (condcomp tune-llm's); computed when missing")
    add_text_arguments(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=integer(at_least=1), default=2)
    p.add_argument("--seed", type=integer(at_least=0), default=0)
    p.set_defaults(func=main)
