"""scikit-learn's digits as images for the DiT: ``(N, 1, S, S)`` floats in [-1, 1] with labels, the same
stratified 80/20 split (fixed seed 0) as the digits ViT, so the test images are the classification study's."""

from __future__ import annotations

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
