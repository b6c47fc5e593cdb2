"""A second modality: scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes, no download) for
a small Vision Transformer.

The images are 4-bit (pixel values 0..16), so the ViT here uses 1x1 patches: 64 pixel tokens in raster order
with learned position embeddings, and a patch embedding that is a table over the 17 intensity levels (token id
= value + 1; id 0 stays the padding id, unused: every image is 64 tokens). The encoder is the same
:class:`~.classification.model.EncoderClassifier` as for text, so every method, measurement and the whole
ablation apply unchanged. Split: stratified 80/20 with a fixed ``random.Random(0)``, the same for every training
seed (paired comparisons need the same test images). ``pip install 'condcomp[vision]'`` (scikit-learn).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from condcomp.experiments.classification.batches import EncodedSplit

LEVELS = 17  # pixel values 0..16
SPLIT_SEED = 0


def load_digits_arrays() -> tuple[list[list[int]], list[int]]:
    """Pixels (N lists of 64 ints in 0..16) and labels, from scikit-learn's bundled copy."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise RuntimeError("--dataset digits needs scikit-learn: pip install 'condcomp[vision]'") from err
    d = load_digits()
    pixels = [[int(v) for v in row] for row in d.data.tolist()]
    return pixels, [int(y) for y in d.target.tolist()]


def split_indices(labels: list[int], test_frac: float = 0.2, seed: int = SPLIT_SEED) -> tuple[list[int], list[int]]:
    """Stratified split: per class, a seeded shuffle and the first ``round(test_frac * n_c)`` to test."""
    rng = random.Random(seed)
    train, test = [], []
    for c in sorted(set(labels)):
        idx = [i for i, y in enumerate(labels) if y == c]
        rng.shuffle(idx)
        n_test = round(test_frac * len(idx))
        test += idx[:n_test]
        train += idx[n_test:]
    return sorted(train), sorted(test)


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
