"""``condcomp calibrate-kv``: learn the full/streaming KV split: a gates file (static) or a router file (per request).

``--method duo`` trains DuoAttention's gates (:mod:`condcomp.experiments.llm.duo_gates`); ``--method importance``
writes Michel et al.'s gradient importance per group (static pruning's ranking) on the same calibration rows, in
the same format; ``--method request`` trains one ``topk`` router per layer that picks each request's full groups
(:mod:`condcomp.experiments.llm.request_split`), into a router file (``.pt``). ``condcomp bench kv``'s
``split-duo-1of3`` reads ``results/kv/duo_gates.json`` and keeps the highest third of the scores in full
(docs/kv-calibration.md); ``split-request-1of3`` reads ``results/kv/request_router_seed0.pt``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from condcomp.cli_args import finite_float, integer, output_file
from condcomp.experiments.llm.importance_file import importance_file

METHODS = ("duo", "importance", "request")
DEFAULT_LR = {"duo": 0.02, "importance": 0.02, "request": 1e-3}


def _calibration(args: argparse.Namespace, texts: list[str] | None, seed: int,
                 held_out: bool = False) -> tuple[Any, list[Any]]:
    """``(model, calibration rows)`` for the command's model, from the local corpora (or ``texts``). ``--mix``:
    the mixture of :mod:`condcomp.experiments.llm.kv_mixture` from the train split (``held_out``: its screen's
    documents); else pass-key rows."""
    from condcomp.bench.kv import CORPORA, load
    from condcomp.bench.kv_cases import corpus_texts, haystack_stream
    from condcomp.experiments.llm.duo_gates import calibration_rows

    model, tok, sep, _ = load(args.model)
    encode = getattr(tok, "encode_plain", None) or tok.encode
    if args.mix:
        from condcomp.experiments.llm.kv_mixture import mixture_rows, mixture_texts

        if texts is None:
            from condcomp.experiments.data import LLM_DATA_ADVICE, resolve_data_dir

            texts = mixture_texts(resolve_data_dir(args.data_dir, LLM_DATA_ADVICE), CORPORA, seed, held_out)
        stream = haystack_stream(texts, encode, sep, min_tokens=64 * args.seq_len)
        return model, mixture_rows(stream, encode, tok.decode, args.seq_len, args.steps, seed=seed, sep_ids=[sep])
    if texts is None:
        from condcomp.experiments.data import LLM_DATA_ADVICE, resolve_data_dir

        texts = corpus_texts(resolve_data_dir(args.data_dir, LLM_DATA_ADVICE), CORPORA, args.seed)
    stream = haystack_stream(texts, encode, sep, min_tokens=8 * args.seq_len)
    return model, calibration_rows(stream, encode, args.seq_len, args.steps, seed=seed)


def run(args: argparse.Namespace, texts: list[str] | None = None) -> Path:
    import torch

    from condcomp.experiments.llm.duo_gates import DuoSettings, save_gates, train_gates
    from condcomp.experiments.progress import progress_bar

    if args.lr is None:
        args.lr = DEFAULT_LR[args.method]
    if args.mix and args.method == "request":
        raise ValueError("--mix calibrates DuoAttention gates (--method duo or importance, and their --evaluate); "
                         "--method request has its own rows (docs/kv-calibration.md): leave --mix out")
    if args.method == "request" and not args.evaluate:
        from condcomp.experiments.llm import calibrate_request

        return calibrate_request.run(args, texts)
    torch.set_num_threads(args.threads)
    settings = DuoSettings(steps=args.steps, seq_len=args.seq_len, lr=args.lr, l1=args.l1, sinks=args.sinks,
                           window=args.window, seed=args.seed, rows="mix" if args.mix else "passkey")
    settings.check()
    out: Path = args.out
    if args.evaluate:
        return evaluate(args, texts)
    # calibration text apart from bench kv's cases (seed 0 of the same corpora): a shifted seed for the rows
    model, calib = _calibration(args, texts, seed=1000 + args.seed)
    rows = [r.ids for r in calib]
    cfg: Any = model.config
    if args.method == "importance":
        from condcomp.bench.kv_variants import computed_importance

        print(f"gradient importance on {len(rows)} rows of {args.seq_len} tokens")
        scores = computed_importance(model, torch.tensor(rows), prompt_len=args.seq_len // 2, batch_size=1)
        save_gates(out, "importance", args.model, scores, args.sinks, args.window, asdict(settings))
        return out
    bar = progress_bar(total=args.steps, desc="calibrate-kv duo")
    checkpoint = out.with_suffix(".partial.pt")

    def on_step(step: int, distill: float, mean_gate: float) -> None:
        bar.update(1, distill=distill, mean_gate=mean_gate)

    try:
        gates, history = train_gates(model, rows, settings, checkpoint=checkpoint, on_step=on_step)
    finally:
        bar.close()  # a run that stops (diverged, interrupted) ends the bar's line before the message
    save_gates(out, "duo", args.model, gates.alpha.detach().double(), args.sinks, args.window, asdict(settings),
               history)
    checkpoint.unlink(missing_ok=True)  # finished: the gates file is the result
    from condcomp.experiments.llm.duo_gates import split_from_scores

    kept = split_from_scores(gates.alpha.detach(), 1 / 3)  # what split-duo-1of3 keeps
    alpha = gates.alpha.detach()
    print(f"wrote {out}: mean gate {float(alpha.mean()):.3f}; keeping a third of {cfg.num_hidden_layers} layers x "
          f"{alpha.shape[1]} groups in full keeps per layer {[len(k) for k in kept]}")
    return out


def evaluate(args: argparse.Namespace, texts: list[str] | None) -> Path:
    """Screen the splits of the ``--evaluate`` gates files (global top ``--fraction``) and router files (``.pt``:
    per-request splits), static pruning's per-layer split (``--importance``) and StreamingLLM against the dense
    model on held-out rows (``--method request``: passkey and plain-text rows in turn); a table and a JSON file."""
    import json

    import torch

    from condcomp.experiments.llm.duo_gates import load_gates, split_from_scores
    from condcomp.experiments.llm.head_importance import keep_groups
    from condcomp.experiments.llm.request_split import RequestSplit, load_router
    from condcomp.experiments.llm.split_eval import Split, differing, evaluate_splits, table
    from condcomp.kv.importance import saved_importance

    if args.method == "request":  # rows no router training saw, plain text among them
        from condcomp.experiments.llm.calibrate_request import calibration

        model, rows = calibration(args, texts, seed=2000 + args.seed, held_out=True)
    else:  # rows no gate training saw (--mix: documents the training rows never read)
        model, rows = _calibration(args, texts, seed=2000 + args.seed, held_out=True)
    cfg: Any = model.config
    L, G = int(cfg.num_hidden_layers), int(cfg.num_key_value_heads)
    keep = max(1, round(args.fraction * G))
    splits: dict[str, Split] = {"streaming (none full)": [[] for _ in range(L)]}
    importance = saved_importance(args.importance, L, G)
    if importance is not None:
        splits[f"importance per layer, {keep} of {G}"] = keep_groups(importance, keep)
        splits[f"importance global {args.fraction:.3g}"] = split_from_scores(importance, args.fraction)
    for path in map(Path, args.evaluate):
        if path.suffix == ".pt":
            splits[f"{path.stem} per request"] = load_router(path, model)
        else:
            record = load_gates(path, L, G)
            if (record["sinks"], record["window"]) != (args.sinks, args.window):  # as a router file's (split_eval)
                raise ValueError(f"{path} holds gates trained for {record['sinks']} + {record['window']} streamed "
                                 f"tokens, the screen streams {args.sinks} + {args.window}: screen it with --sinks "
                                 f"{record['sinks']} --window {record['window']}")
            splits[f"{path.stem} global {args.fraction:.3g}"] = split_from_scores(record["scores"], args.fraction)
    print(f"screening {len(splits)} splits on {len(rows)} held-out rows of {args.seq_len} tokens")
    torch.set_num_threads(args.threads)
    results = evaluate_splits(model, rows, splits, args.sinks, args.window)
    text = table(results, sum(r.answer is not None for r in rows))
    for name, r in results.items():
        split = splits.get(name)
        if isinstance(split, RequestSplit) and importance is not None:  # against static pruning's, same keep
            r["differs_from_static"] = differing(r["choices"], keep_groups(importance, split.keep))
            text += f"\n{name}: the (row, layer) choices differ from importance's {split.keep} of {G} per layer " \
                    f"in {r['differs_from_static']:.1%} of {len(rows) * L} pairs"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    described = {n: (s if isinstance(s, list) else f"per request, {s.keep} of {s.groups}") for n, s in splits.items()}
    args.out.write_text(json.dumps({"rows": len(rows), "seq_len": args.seq_len, "sinks": args.sinks,
                                    "window": args.window, "seed": args.seed, "splits": described,
                                    "results": results, "table": text}, indent=1))
    return Path(args.out)


def _cmd(args: argparse.Namespace) -> int:
    run(args)
    return 0


def add_commands(sub: Any) -> None:
    """Register ``calibrate-kv`` on the ``condcomp`` parser."""
    p = sub.add_parser("calibrate-kv", help="learn the full/streaming KV split: DuoAttention gates or gradient "
                                            "importance (a gates file), or per-request routers (a router file)",
                       description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--method", choices=METHODS, default="duo",
                   help="duo: train DuoAttention's gates (model frozen); importance: gradient importance per group; "
                        "request: train per-request topk routers (model frozen)")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny-llama"),
                   help="smollm2 (needs the llm extra, docs/llm.md) or tiny-llama (random, no download)")
    p.add_argument("--out", type=output_file, required=True,
                   help="the file to write: gates (JSON), e.g. results/kv/duo_gates.json, or routers (--method "
                        "request, .pt)")
    p.add_argument("--steps", type=integer(at_least=1), default=100,
                   help="training steps, one calibration row each (importance: the number of rows)")
    p.add_argument("--seq-len", type=integer(at_least=2), default=1024,
                   help="tokens per calibration row (> sinks + window)")
    p.add_argument("--lr", type=finite_float(above=0), default=None,
                   help="Adam's learning rate (default: 0.02 on the gates, DuoAttention's; 1e-3 on the request "
                        "routers' scorers)")
    p.add_argument("--l1", type=finite_float(at_least=0), default=0.05,
                   help="lambda: the price per unit of mean gate")
    p.add_argument("--sinks", type=integer(at_least=0), default=4,
                   help="streaming pattern: first tokens every query sees")
    p.add_argument("--window", type=integer(at_least=1), default=252,
                   help="streaming pattern: recent tokens every query sees")
    p.add_argument("--evaluate", nargs="+", default=None, metavar="GATES",
                   help="instead of calibrating: screen the splits these gates files give (and static pruning's, "
                        "and StreamingLLM) against the dense model on --steps held-out rows; --out gets the JSON")
    p.add_argument("--mix", action="store_true",
                   help="duo, importance and --evaluate: calibrate on a mixture from the corpora's train split "
                        "(made-up facts in other wordings than bench kv's, quoted passages, plain text; "
                        "docs/kv-calibration.md) instead of pass-key prompts on the test split's text")
    p.add_argument("--fraction", type=finite_float(above=0, at_most=1), default=1 / 3,
                   help="--evaluate: the share of groups kept in full")
    p.add_argument("--importance", type=importance_file, default=Path("results/llm/static_importance.json"),
                   help="--evaluate and request --init importance: static pruning's group importance "
                        "(static_importance.json, condcomp tune-llm's)")
    p.add_argument("--init", choices=("importance", "duo"), default="importance",
                   help="request: the routers' warm start, static pruning's ranking (--importance, what "
                        "split-static-1of3 keeps) or the DuoAttention gates' (--duo-gates)")
    p.add_argument("--duo-gates", type=Path, default=Path("results/kv/duo_gates.json"),
                   help="request --init duo: the gates file to start from")
    p.add_argument("--keep", type=integer(at_least=1), default=1, help="request: KV groups per layer kept in full")
    p.add_argument("--data-dir", default=None,
                   help="the staged corpora (default $CONDCOMP_DATA_DIR, else ../shared/data)")
    p.add_argument("--threads", type=integer(at_least=1), default=1)
    p.add_argument("--seed", type=integer(at_least=0), default=0)
    p.set_defaults(func=_cmd)
