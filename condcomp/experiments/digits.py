"""scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes, no download), shared by the
classification study's ViT (:mod:`.classification.digit_tokens`) and the DiT study (:mod:`.dit.data`).

The images are 4-bit (pixel values 0..16). Split: stratified 80/20 with a fixed ``random.Random(0)``, the same for
every training seed (paired comparisons need the same test images). ``pip install 'condcomp[vision]'``
(scikit-learn).
"""

from __future__ import annotations

import random

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
