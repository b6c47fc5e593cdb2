"""Fréchet distance between two sets of feature vectors (the FID formula on any feature extractor's outputs).

``FD = |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2)``, in float64 with symmetric
eigen-decompositions (``tr((S_a S_b)^1/2)`` equals the last trace and the symmetric form has real, non-negative
eigenvalues, so no complex ``sqrtm`` clean-up is needed).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _psd_sqrt(m: Tensor) -> Tensor:
    vals, vecs = torch.linalg.eigh(m)
    return (vecs * vals.clamp_min(0).sqrt()) @ vecs.T


def gaussian_stats(features: Tensor) -> tuple[Tensor, Tensor]:
    """Mean ``(F,)`` and unbiased covariance ``(F, F)`` of ``features (N, F)`` in float64 (N >= 2)."""
    if features.dim() != 2 or features.shape[0] < 2:
        raise ValueError(f"Fréchet distance: features must be (N >= 2, F), got {tuple(features.shape)}")
    f = features.double()
    if not bool(torch.isfinite(f).all()):
        raise ValueError("Fréchet distance: features contain NaN or inf (did sampling diverge?)")
    return f.mean(0), torch.cov(f.T).reshape(f.shape[1], f.shape[1])


def frechet_from_stats(mu_a: Tensor, cov_a: Tensor, mu_b: Tensor, cov_b: Tensor) -> float:
    """The Fréchet distance between the Gaussians ``N(mu_a, cov_a)`` and ``N(mu_b, cov_b)``."""
    if mu_a.shape != mu_b.shape or cov_a.shape != cov_b.shape:
        raise ValueError(f"Fréchet distance: feature widths differ ({tuple(mu_a.shape)} vs {tuple(mu_b.shape)})")
    root_a = _psd_sqrt(cov_a.double())
    cross = torch.linalg.eigvalsh(root_a @ cov_b.double() @ root_a).clamp_min(0).sqrt().sum()
    diff = mu_a.double() - mu_b.double()
    return float(diff @ diff + torch.trace(cov_a.double()) + torch.trace(cov_b.double()) - 2 * cross)


def frechet_distance(features_a: Tensor, features_b: Tensor) -> float:
    """Fréchet distance between Gaussians fitted to ``features_a (N, F)`` and ``features_b (M, F)``."""
    return frechet_from_stats(*gaussian_stats(features_a), *gaussian_stats(features_b))
