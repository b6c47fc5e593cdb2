"""Screen full/streaming KV splits cheaply: each split's model against the dense model on held-out retrieval rows.

A split (per layer, the KV groups kept in full; the others stream ``sinks`` + ``window`` tokens) is run as the
gated attention with every gate 0 or 1 (:mod:`condcomp.experiments.llm.duo_attention`; the tests check that this
equals the streaming rule exactly), one cache-free forward per row, on rows built like the calibration rows but
from another seed. Per split, over the tokens past ``sinks + window`` (earlier tokens see the same keys under every
split):

- ``hidden_mse``: the gate training's distance (last-layer hidden states against the dense model's);
- ``nll`` / ``ppl_ratio``: next-token loss, and its exponentiated difference to the dense model's;
- ``answer_acc``: rows whose passkey answer tokens are all the argmax predictions (teacher-forced retrieval).

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
def evaluate_splits(model: nn.Module, rows: Sequence[CalibrationRow], splits: dict[str, list[list[int]]],
                    sinks: int, window: int) -> dict[str, dict[str, float]]:
    """Per split name: ``hidden_mse``, ``nll``, ``ppl_ratio``, ``answer_acc``, ``full_frac`` (kept share of all
    groups); ``dense`` is added as the reference row."""
    cfg: Any = getattr(model, "config")  # noqa: B009
    G = int(cfg.num_key_value_heads)
    start = sinks + window  # the first position whose keys differ between the patterns
    sums: dict[str, dict[str, float]] = {n: {"hidden_mse": 0.0, "nll": 0.0, "tokens": 0.0, "correct": 0.0}
                                         for n in ["dense", *splits]}
    for row in rows:
        ids = torch.tensor([row.ids])  # (1, T)
        if ids.shape[1] <= start + 1:
            raise ValueError(f"rows of {ids.shape[1]} tokens are too short to screen a window of {start} tokens")
        dense_h, dense_logits = _outputs(model, ids)
        a, b = row.answer
        for name in ["dense", *splits]:
            if name == "dense":
                h, logits = dense_h, dense_logits
            else:
                with gated(model, split_gates(splits[name], G, sinks, window)):
                    h, logits = _outputs(model, ids)
            s = sums[name]
            s["hidden_mse"] += float((h[:, start:] - dense_h[:, start:]).float().pow(2).mean())
            targets = ids[0, start + 1:]
            s["nll"] += float(F.cross_entropy(logits[0, start:-1].float(), targets, reduction="sum"))
            s["tokens"] += targets.numel()
            s["correct"] += float(bool((logits[0, a - 1:b - 1].argmax(-1) == ids[0, a:b]).all()))
    out = {}
    for name, s in sums.items():
        kept = sum(len(k) for k in splits[name]) / (len(splits[name]) * G) if name in splits else 1.0
        nll = s["nll"] / s["tokens"]
        out[name] = {"hidden_mse": s["hidden_mse"] / len(rows), "nll": nll, "answer_acc": s["correct"] / len(rows),
                     "full_frac": kept}
    for name in out:
        out[name]["ppl_ratio"] = math.exp(out[name]["nll"] - out["dense"]["nll"])
    return out


def table(results: dict[str, dict[str, float]], rows: int) -> str:
    """A markdown table of :func:`evaluate_splits`' results."""
    lines = [f"| split | full groups | hidden MSE | ppl x dense | answer acc ({rows} rows) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['full_frac']:.3f} | {r['hidden_mse']:.4g} | {r['ppl_ratio']:.3f} | "
                     f"{r['answer_acc']:.2f} |")
    return "\n".join(lines)
