"""Images for the DiT: ``(N, C, S, S)`` floats in [-1, 1] with int64 labels, as ``{"train": ..., "test": ...}``.

- scikit-learn's digits: the same stratified 80/20 split (fixed seed 0) as the digits ViT, so the test images
  are the classification study's.
- any other labelled image set from an ``.npz`` file (``--data PATH``), e.g. CIFAR-10 converted once (docs/dit.md):
  arrays ``train_images``, ``train_labels``, ``test_images``, ``test_labels``; images uint8 in 0..255, shaped
  ``(N, S, S, C)`` or ``(N, C, S, S)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from condcomp.experiments.digits import LEVELS, load_digits_arrays, split_indices


def to_unit_range(pixels: Tensor) -> Tensor:
    """4-bit pixel values 0..16 -> [-1, 1]."""
    return pixels.float() / (LEVELS - 1) * 2.0 - 1.0


def digits_images(image_size: int = 8) -> dict[str, tuple[Tensor, Tensor]]:
    """``{"train": (images, labels), "test": (images, labels)}``; images ``(N, 1, S, S)`` in [-1, 1].

    ``image_size`` 8 (native) or a multiple of 8 (bilinear upsampling, e.g. 16 for 64 tokens of 2x2 patches).
    """
    if image_size < 8 or image_size % 8:
        raise ValueError(f"digits images: image_size must be 8 or a multiple of 8, got {image_size}")
    pixels, labels = load_digits_arrays()
    images = to_unit_range(torch.tensor(pixels)).reshape(-1, 1, 8, 8)  # (N, 1, 8, 8)
    if image_size != 8:
        images = torch.nn.functional.interpolate(images, size=(image_size, image_size), mode="bilinear",
                                                 align_corners=False)
    y = torch.tensor(labels)
    train, test = split_indices(labels)
    return {"train": (images[train], y[train]), "test": (images[test], y[test])}


NPZ_KEYS = ("train_images", "train_labels", "test_images", "test_labels")


def npz_images(path: Path) -> dict[str, tuple[Tensor, Tensor]]:
    """A labelled image set from an ``.npz`` file (see the module docstring), scaled to [-1, 1], channels first."""
    import numpy as np

    if not path.is_file():
        raise FileNotFoundError(f"--data {path} does not exist (an .npz with {', '.join(NPZ_KEYS)})")
    with np.load(path) as f:
        missing = [k for k in NPZ_KEYS if k not in f.files]
        if missing:
            raise ValueError(f"--data {path}: missing arrays {missing}; expected {list(NPZ_KEYS)}")
        arrays = {k: f[k] for k in NPZ_KEYS}
    out = {}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 4 or images.dtype != np.uint8 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"--data {path}: {split}_images must be uint8 (N, S, S, C) or (N, C, S, S) with one "
                             f"label per image, got {images.dtype} {images.shape} and {labels.shape[0]} labels")
        x = torch.from_numpy(images)
        if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
            x = x.permute(0, 3, 1, 2)  # (N, S, S, C) -> (N, C, S, S)
        out[split] = (x.float() / 255.0 * 2.0 - 1.0, torch.from_numpy(labels.astype(np.int64)).flatten())
    return out
