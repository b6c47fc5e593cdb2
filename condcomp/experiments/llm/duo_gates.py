"""DuoAttention gate training's calibration text, and the names it had here.

The training, the gates file and the split (:func:`train_gates`, :func:`save_gates`, :func:`load_gates`,
:func:`split_from_scores`, ...) moved to :mod:`condcomp.kv.duo_gates` (public through
:mod:`condcomp.kv.calibration`); they are re-exported here for the studies' code. What stays is the study's data:
:func:`calibration_rows`, passkey prompts from the local corpora (:func:`condcomp.bench.kv_cases.passkey_cases`)
followed by the answer, so retrieving the key from far back is part of what the gated model must reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from condcomp.kv.duo_gates import (
    FORMAT,
    HISTORY_EVERY,
    DuoSettings,
    StepFn,
    distill_loss,
    hidden_states,
    load_gates,
    save_gates,
    split_from_scores,
    train_gates,
    train_loop,
    train_step,
)

__all__ = ["FORMAT", "HISTORY_EVERY", "CalibrationRow", "DuoSettings", "StepFn", "calibration_rows", "distill_loss",
           "hidden_states", "load_gates", "save_gates", "split_from_scores", "train_gates", "train_loop", "train_step"]


@dataclass(frozen=True)
class CalibrationRow:
    """``ids``: a passkey prompt then its answer; ``answer``: the ``(start, end)`` of the key's first answer tokens
    (None, with ``key`` "": a row of plain text)."""

    ids: list[int]
    key: str
    answer: tuple[int, int] | None


def calibration_rows(stream: Sequence[int], encode: Callable[[str], list[int]], seq_len: int, n: int,
                     seed: int) -> list[CalibrationRow]:
    """``n`` rows of exactly ``seq_len`` tokens: a passkey prompt, then its answer (the key, said three times).
    The first rows of a larger ``n`` are the rows of a smaller one (a run can be extended)."""
    from condcomp.bench.kv_cases import passkey_cases

    answer_room = 16
    if seq_len <= answer_room:
        raise ValueError(f"a calibration row of {seq_len} tokens leaves no room for a passkey prompt")
    rows = []
    for case in passkey_cases(stream, encode, seq_len - answer_room, n, seed):
        tail = encode(f" {case.key}. The pass key is {case.key}. The pass key is {case.key}.")
        P = len(case.ids)
        rows.append(CalibrationRow((case.ids + tail)[:seq_len], case.key, (P, P + len(encode(f" {case.key}")))))
    short = [len(r.ids) for r in rows if len(r.ids) != seq_len]
    if short:
        raise ValueError(f"calibration rows came out {short[0]} tokens long, not {seq_len} (the answer text "
                         "tokenized shorter than expected)")
    return rows
