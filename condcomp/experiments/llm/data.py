"""Language-modelling data for continue-tuning a causal LM: the staged datasets' texts, packed into fixed-length
sequences, each one a "request": a prompt (its first ``prompt_len`` tokens) and a continuation.

A sequence starts at a document start; documents of one dataset (each followed by a separator token) are appended
until the sequence is full, the last one cut where it ends (the rest of a cut document is dropped, so the next
sequence starts at a document start again). Train sequences come from the train splits only; evaluation
sequences from the test splits; the calibration sequences (static pruning's head importance) are train-split
sequences the tuning never sees.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from condcomp.experiments.data import load_named

# SNLI contributes its premises (image captions), each once; the hypotheses are written to contrast them.
LM_DATASETS = ("ag_news", "dbpedia_14", "imdb", "yelp", "snli")


@dataclass
class PackedSplit:
    """Packed sequences ``ids (N, seq_len)`` and the dataset each row came from."""

    ids: Tensor
    sources: list[str]

    def of(self, dataset: str) -> Tensor:
        """The rows of one dataset."""
        rows = [i for i, s in enumerate(self.sources) if s == dataset]
        return self.ids[rows]


def clean_text(text: str) -> str:
    """IMDB's ``<br />`` markup as newlines; surrounding whitespace stripped."""
    return text.replace("<br /><br />", "\n").replace("<br />", "\n").strip()


def pack_documents(docs: Iterable[Sequence[int]], seq_len: int, sep_id: int, limit: int | None = None
                   ) -> list[list[int]]:
    """Sequences of exactly ``seq_len`` tokens, each starting at a document start (see the module docstring).

    >>> pack_documents([[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]], seq_len=4, sep_id=0)
    [[1, 2, 0, 3], [6, 0, 7, 8]]
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    out: list[list[int]] = []
    current: list[int] = []
    for doc in docs:
        if limit is not None and len(out) >= limit:
            break
        current.extend(doc)
        current.append(sep_id)
        if len(current) >= seq_len:
            out.append(current[:seq_len])
            current = []
    return out[:limit] if limit is not None else out


def dataset_documents(name: str, data_dir: Path, split: str, seed: int) -> list[str]:
    """The cleaned, non-empty texts of one staged split in a seeded order (SNLI: unique premises)."""
    texts = load_named(name, data_dir, split).texts
    if name == "snli":
        texts = list(dict.fromkeys(texts))
    texts = [t for t in (clean_text(t) for t in texts) if t]
    random.Random(f"{name}/{split}/{seed}").shuffle(texts)
    return texts


def packed_split(encode: Callable[[list[str]], list[list[int]]], data_dir: Path, split: str,
                 per_dataset: int, seq_len: int, sep_id: int, seed: int = 0,
                 datasets: Sequence[str] = LM_DATASETS, chunk: int = 256) -> PackedSplit:
    """``per_dataset`` packed sequences of each dataset, interleaved (row i comes from dataset i mod n).

    Texts are tokenized ``chunk`` at a time until enough sequences exist (only what is needed is tokenized).
    A dataset with too little text for ``per_dataset`` sequences is an error naming it.
    """
    per: dict[str, list[list[int]]] = {}
    for name in datasets:
        texts = dataset_documents(name, data_dir, split, seed)
        seqs: list[list[int]] = []
        pending: list[list[int]] = []
        for start in range(0, len(texts), chunk):
            pending.extend(encode(texts[start:start + chunk]))
            seqs = pack_documents(pending, seq_len, sep_id, per_dataset)
            if len(seqs) >= per_dataset:
                break
        if len(seqs) < per_dataset:
            raise ValueError(f"{name} ({split}) packs into only {len(seqs)} sequences of {seq_len} tokens; "
                             f"{per_dataset} were asked for")
        per[name] = seqs
    rows: list[list[int]] = []
    sources: list[str] = []
    for i in range(per_dataset):
        for name in datasets:
            rows.append(per[name][i])
            sources.append(name)
    return PackedSplit(torch.tensor(rows, dtype=torch.long), sources)


def split_calibration(train: PackedSplit, calib_per_dataset: int, datasets: Sequence[str]) -> tuple[
        PackedSplit, PackedSplit]:
    """``(tuning rows, calibration rows)``: the last ``calib_per_dataset`` rows of each dataset calibrate."""
    n = len(datasets) * calib_per_dataset
    if n >= train.ids.shape[0]:
        raise ValueError(f"{n} calibration rows leave no training rows (of {train.ids.shape[0]})")
    cut = train.ids.shape[0] - n
    return (PackedSplit(train.ids[:cut], train.sources[:cut]), PackedSplit(train.ids[cut:], train.sources[cut:]))


def tokenizer_encoder(tokenizer: object) -> tuple[Callable[[list[str]], list[list[int]]], int]:
    """``(encode, separator id)`` for a transformers tokenizer: no special tokens added, documents separated by
    ``<|endoftext|>`` where the vocabulary has it (SmolLM2's pretraining separator), else the EOS token."""
    def encode(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]  # type: ignore[operator]

    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    sep = vocab.get("<|endoftext|>", getattr(tokenizer, "eos_token_id", None))
    if sep is None:
        raise ValueError("the tokenizer has neither <|endoftext|> nor an EOS token to separate documents")
    return encode, int(sep)
