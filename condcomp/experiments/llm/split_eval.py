"""Screen full/streaming KV splits cheaply: each split's model against the dense model on held-out retrieval rows.

A split (per layer, the KV groups kept in full; the others stream ``sinks`` + ``window`` tokens) is run as the
gated attention with every gate 0 or 1 (:mod:`condcomp.experiments.llm.duo_attention`; the tests check that this
equals the streaming rule exactly), one cache-free forward per row, on rows built like the calibration rows but
from another seed. Per split, over the tokens past ``sinks + window`` (earlier tokens see the same keys under every
split):

- ``hidden_mse``: the gate training's distance (last-layer hidden states against the dense model's);
- ``nll`` / ``ppl_ratio``: next-token loss, and its exponentiated difference to the dense model's;
- ``answer_acc``: passkey rows whose answer tokens are all the argmax predictions (teacher-forced retrieval).

A per-request split (:class:`~condcomp.experiments.llm.request_split.RequestSplit`) is run through its routers
(eval: hard top-k per row and layer); its entry also gives ``choices``: per row, per layer, the groups kept in full.

This sees what a continuation's perplexity hides: whether a streamed group still reaches the key far back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from condcomp.experiments.llm.duo_attention import DuoGates, gated
from condcomp.experiments.llm.duo_gates import CalibrationRow
from condcomp.experiments.llm.request_split import RequestSplit, routed

Split = list[list[int]] | RequestSplit  # per layer the kept groups (every row), or a per-request split


def split_gates(kept: Sequence[Sequence[int]], groups: int, sinks: int, window: int) -> DuoGates:
    """Gates ``(L, G)`` that are 1 for the kept groups and 0 for the streamed ones."""
    gates = DuoGates(len(kept), groups, sinks, window, init=0.0)
    with torch.no_grad():
        for layer, gs in enumerate(kept):
            for g in gs:
                gates.alpha[layer, g] = 1.0
    return gates


def _outputs(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(hidden (1, T, D), logits (1, T, V))``."""
    base = getattr(model, "base_model", model)
    hidden = base(input_ids=ids, use_cache=False).last_hidden_state
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    return hidden, head(hidden)


@torch.no_grad()
def evaluate_splits(model: nn.Module, rows: Sequence[CalibrationRow], splits: dict[str, Split],
                    sinks: int, window: int) -> dict[str, dict[str, Any]]:
    """Per split name: ``hidden_mse``, ``nll``, ``ppl_ratio``, ``answer_acc`` (passkey rows; 0 without any),
    ``full_frac`` (kept share of all groups), and for a per-request split ``choices``; ``dense`` is added as the
    reference row."""
    cfg: Any = getattr(model, "config")  # noqa: B009
    G = int(cfg.num_key_value_heads)
    start = sinks + window  # the first position whose keys differ between the patterns
    sums: dict[str, dict[str, float]] = {n: {"hidden_mse": 0.0, "nll": 0.0, "tokens": 0.0, "correct": 0.0}
                                         for n in ["dense", *splits]}
    choices: dict[str, list[list[list[int]]]] = {n: [] for n, s in splits.items() if isinstance(s, RequestSplit)}
    for row in rows:
        ids = torch.tensor([row.ids])  # (1, T)
        if ids.shape[1] <= start + 1:
            raise ValueError(f"rows of {ids.shape[1]} tokens are too short to screen a window of {start} tokens")
        dense_h, dense_logits = _outputs(model, ids)
        for name in ["dense", *splits]:
            split = splits.get(name)
            if split is None:
                h, logits = dense_h, dense_logits
            elif isinstance(split, RequestSplit):
                if (split.sinks, split.window) != (sinks, window):
                    raise ValueError(f"{name} streams {split.sinks} + {split.window} tokens, the screen "
                                     f"{sinks} + {window}: screen it with --sinks {split.sinks} --window "
                                     f"{split.window}")
                with routed(model, split.eval()) as gates:
                    h, logits = _outputs(model, ids)
                choices[name].append(split.kept(gates)[0].tolist())  # (L, keep)
            else:
                with gated(model, split_gates(split, G, sinks, window)):
                    h, logits = _outputs(model, ids)
            s = sums[name]
            s["hidden_mse"] += float((h[:, start:] - dense_h[:, start:]).float().pow(2).mean())
            targets = ids[0, start + 1:]
            s["nll"] += float(F.cross_entropy(logits[0, start:-1].float(), targets, reduction="sum"))
            s["tokens"] += targets.numel()
            if row.answer is not None:
                a, b = row.answer
                s["correct"] += float(bool((logits[0, a - 1:b - 1].argmax(-1) == ids[0, a:b]).all()))
    passkeys = max(1, sum(row.answer is not None for row in rows))
    out: dict[str, dict[str, Any]] = {}
    for name, s in sums.items():
        split = splits.get(name)
        if isinstance(split, RequestSplit):
            kept = split.keep / split.groups
        else:
            kept = sum(len(k) for k in split) / (len(split) * G) if split is not None else 1.0
        nll = s["nll"] / s["tokens"]
        out[name] = {"hidden_mse": s["hidden_mse"] / len(rows), "nll": nll, "answer_acc": s["correct"] / passkeys,
                     "full_frac": kept}
        if name in choices:
            out[name]["choices"] = choices[name]
    for name in out:
        out[name]["ppl_ratio"] = math.exp(out[name]["nll"] - out["dense"]["nll"])
    return out


def differing(choices: Sequence[Sequence[Sequence[int]]], kept: Sequence[Sequence[int]]) -> float:
    """The share of (row, layer) pairs whose chosen groups ``choices[row][layer]`` differ from ``kept[layer]``."""
    pairs = [(set(c), set(k)) for row in choices for c, k in zip(row, kept, strict=True)]
    return sum(a != b for a, b in pairs) / max(1, len(pairs))


def table(results: dict[str, dict[str, Any]], rows: int) -> str:
    """A markdown table of :func:`evaluate_splits`' results."""
    lines = [f"| split | full groups | hidden MSE | ppl x dense | answer acc ({rows} passkey rows) |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['full_frac']:.3f} | {r['hidden_mse']:.4g} | {r['ppl_ratio']:.3f} | "
                     f"{r['answer_acc']:.2f} |")
    return "\n".join(lines)
