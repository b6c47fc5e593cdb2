"""The digits as a second modality of the classification study: a small Vision Transformer over pixel tokens.

The images are 4-bit (pixel values 0..16), so the ViT here uses 1x1 patches: 64 pixel tokens in raster order
with learned position embeddings, and a patch embedding that is a table over the 17 intensity levels (token id
= value + 1; id 0 stays the padding id, unused: every image is 64 tokens). The encoder is the same
:class:`~.model.EncoderClassifier` as for text, so every method, measurement and the whole ablation apply
unchanged. The images and their split: :mod:`condcomp.experiments.digits`.
"""

from __future__ import annotations

from typing import Any

import torch

from condcomp.experiments.classification.batches import EncodedSplit
from condcomp.experiments.digits import LEVELS, load_digits_arrays, split_indices


def encode_images(pixels: list[list[int]], labels: list[int], idx: list[int]) -> EncodedSplit:
    ids = torch.tensor([[v + 1 for v in pixels[i]] for i in idx], dtype=torch.long)  # (N, 64), ids 1..17
    if ids.numel() and (int(ids.min()) < 1 or int(ids.max()) > LEVELS):
        raise ValueError(f"digits: pixel values must be in 0..{LEVELS - 1}")
    return EncodedSplit(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([labels[i] for i in idx]))


def prepare_digits(max_train: int | None = None, max_test: int | None = None) -> dict[str, Any]:
    """The encoded train/test splits and the facts the model needs (vocab = 18 ids, 10 classes)."""
    pixels, labels = load_digits_arrays()
    tr, te = split_indices(labels)
    tr, te = tr[:max_train] if max_train else tr, te[:max_test] if max_test else te
    notes = {"dataset": "digits", "note": "scikit-learn's bundled digits (8x8, 4-bit); stratified 80/20 split, "
             "fixed seed 0; a ViT with 1x1 patches", "train_rows": len(tr), "test_rows": len(te),
             "skipped_rows": {"train": 0, "test": 0}, "sources": ["sklearn.datasets.load_digits"]}
    return {"train": encode_images(pixels, labels, tr), "test": encode_images(pixels, labels, te),
            "vocab_size": LEVELS + 1, "num_classes": 10, "notes": notes}
