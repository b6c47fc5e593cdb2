"""``condcomp calibrate-kv --method request``: train the per-request full/window split's routers into a router file.

Calibration text: passkey rows alone all look alike (haystack + needle), so a per-request router would have little
to tell apart; every other row is plain text of one local corpus (IMDB, AG News, Yelp or DBpedia in turn), so the
requests differ. Plain-text rows come from the corpora's test splits in a seeded order (:func:`plain_rows`),
restricted to documents bench kv's cases never read (past the first ``BENCH_DOCS`` of its order) and apart from the
held-out screen's documents (from ``HELD_OUT_DOC`` on); passkey rows use the duo calibration's seeds (training
``1000 + seed``, screen ``2000 + seed``).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from condcomp.experiments.llm.duo_gates import CalibrationRow

BENCH_DOCS = 500  # per corpus: bench kv's haystack (seed 0) reads under 100 of each corpus' documents
HELD_OUT_DOC = 1500  # per corpus: the screen's rows start here (Yelp's staged test split has 2000)


def plain_rows(data_dir: Path, corpora: Sequence[str], encode: Callable[[str], list[int]], sep: int, seq_len: int,
               n: int, seed: int, held_out: bool = False) -> list[CalibrationRow]:
    """``n`` rows of ``seq_len`` tokens of plain text, each from one corpus (corpora in turn). Training rows
    (``held_out`` False): documents ``BENCH_DOCS .. HELD_OUT_DOC`` of bench kv's order, shuffled by ``seed``;
    held-out rows: documents from ``HELD_OUT_DOC`` on, in bench kv's order."""
    from condcomp.bench.kv_cases import haystack_stream
    from condcomp.experiments.llm.data import dataset_documents

    per = -(-n // len(corpora))  # rows per corpus
    rows_of: list[list[list[int]]] = []
    for name in corpora:
        docs = dataset_documents(name, data_dir, "test", 0)  # bench kv's order
        if len(docs) <= HELD_OUT_DOC:
            raise ValueError(f"{name}'s test split holds {len(docs)} documents; plain-text calibration rows need "
                             f"more than {HELD_OUT_DOC}")
        pool = docs[HELD_OUT_DOC:] if held_out else docs[BENCH_DOCS:HELD_OUT_DOC]
        if not held_out:
            random.Random(f"request-rows/{name}/{seed}").shuffle(pool)
        stream = haystack_stream(pool, encode, sep, min_tokens=per * seq_len)
        if len(stream) < per * seq_len:
            raise ValueError(f"{name} gives {len(stream)} tokens, fewer than {per} rows of {seq_len}")
        rows_of.append([stream[i * seq_len:(i + 1) * seq_len] for i in range(per)])
    mixed = [rows_of[i % len(corpora)][i // len(corpora)] for i in range(n)]
    return [CalibrationRow(ids, "", None) for ids in mixed]


def mixed_rows(passkey: Sequence[CalibrationRow], plain: Sequence[CalibrationRow], n: int) -> list[CalibrationRow]:
    """``n`` rows: passkey and plain text in turn (passkey first)."""
    return [(passkey if i % 2 == 0 else plain)[i // 2] for i in range(n)]


def calibration(args: argparse.Namespace, texts: list[str] | None, seed: int, held_out: bool) -> tuple[Any, list[Any]]:
    """``(model, rows)``: ``args.steps`` passkey and plain-text rows in turn (``texts``: passkey haystack only,
    for tests; plain rows then come from ``texts`` too)."""
    from condcomp.bench.kv import CORPORA, load
    from condcomp.bench.kv_cases import corpus_texts, haystack_stream
    from condcomp.experiments.llm.duo_gates import calibration_rows

    model, tok, sep, _ = load(args.model)
    encode = getattr(tok, "encode_plain", None) or tok.encode
    n_passkey, n_plain = (args.steps + 1) // 2, args.steps // 2
    if texts is None:
        from condcomp.experiments.data import LLM_DATA_ADVICE, resolve_data_dir

        data_dir = resolve_data_dir(args.data_dir, LLM_DATA_ADVICE)
        plain = plain_rows(data_dir, CORPORA, encode, sep, args.seq_len, n_plain, args.seed, held_out)
        texts = corpus_texts(data_dir, CORPORA, args.seed)
    else:  # tests: the given texts, one stream
        stream = haystack_stream(texts, encode, sep, min_tokens=n_plain * args.seq_len)
        if len(stream) < n_plain * args.seq_len:
            raise ValueError(f"the texts give {len(stream)} tokens, fewer than {n_plain} rows of {args.seq_len}")
        plain = [CalibrationRow(stream[i * args.seq_len:(i + 1) * args.seq_len], "", None) for i in range(n_plain)]
    stream = haystack_stream(texts, encode, sep, min_tokens=8 * args.seq_len)
    passkey = calibration_rows(stream, encode, args.seq_len, n_passkey, seed=seed)
    return model, mixed_rows(passkey, plain, args.steps)


def init_scores(args: argparse.Namespace, model: Any) -> list[list[float]]:
    """The warm start per layer: static pruning's ranking (``--init importance``) or the DuoAttention gates'."""
    from condcomp.experiments.llm.duo_gates import load_gates
    from condcomp.experiments.llm.head_importance import warm_start_scores
    from condcomp.experiments.llm.request_split import model_shape
    from condcomp.kv.importance import saved_importance

    L, _, G, _ = model_shape(model)
    if args.init == "duo":
        return warm_start_scores(load_gates(args.duo_gates, L, G)["scores"])
    scores = saved_importance(args.importance, L, G)
    if scores is None:
        raise FileNotFoundError(f"--init importance needs static pruning's group importance for a {L} x {G} model at "
                                f"{args.importance} (`condcomp tune-llm` writes it; or calibrate-kv --method "
                                "importance for a gates file, then --init duo --duo-gates FILE)")
    return warm_start_scores(scores)


def run(args: argparse.Namespace, texts: list[str] | None = None) -> Path:
    """Train the routers (resumable: a ``.partial.pt`` checkpoint beside ``--out``) and write the router file."""
    import torch

    from condcomp.experiments.llm.request_split import RequestSettings, model_shape, save_router, train_router
    from condcomp.experiments.progress import progress_bar

    torch.set_num_threads(args.threads)
    settings = RequestSettings(steps=args.steps, seq_len=args.seq_len, lr=args.lr, keep=args.keep, sinks=args.sinks,
                               window=args.window, seed=args.seed, init=args.init)
    model, rows = calibration(args, texts, seed=1000 + args.seed, held_out=False)
    settings.check(model_shape(model)[2])
    init = init_scores(args, model)
    out: Path = args.out
    bar = progress_bar(total=args.steps, desc="calibrate-kv request")
    checkpoint = out.with_suffix(".partial.pt")

    def on_step(step: int, distill: float, moved: float) -> None:
        bar.update(1, distill=distill, moved=moved)

    try:
        split, history = train_router(model, [r.ids for r in rows], settings, init, checkpoint=checkpoint,
                                      on_step=on_step)
    finally:
        bar.close()  # a run that stops (diverged, interrupted) ends the bar's line before the message
    save_router(out, split, args.model, model, asdict(settings), history)
    checkpoint.unlink(missing_ok=True)  # finished: the router file is the result
    print(f"wrote {out}: {args.steps} steps, last distillation {history[-1][1]:.4g}")
    return out
