"""Differentiable stand-ins for hard top-k selection, and the pooling and entropy the routers share.

The hard rule keeps head ``h`` iff its 1-based rank ``rho_h`` (by score) satisfies ``rho_h <= k``. Its soft
counterpart replaces the rank by a soft rank and the step by a sigmoid, so the task loss reaches both the
scores (through the soft ranks) and the budget ``s`` (through the threshold).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``x (B, T, D)`` over real tokens (``mask (B, T)`` True = real) -> ``(B, D)``.

    A row with no real token pools to zeros instead of NaN.
    """
    if mask is None:
        return x.mean(1) if x.shape[1] else x.sum(1)  # T = 0: zeros, not 0/0
    w = mask.to(x.dtype).unsqueeze(-1)  # (B, T, 1)
    return (x * w).sum(1) / w.sum(1).clamp_min(1.0)


def rows_with_tokens(x: Tensor, mask: Tensor | None) -> Tensor | None:
    """``(B,)`` True for the rows of ``x (B, T, D)`` with a real token; None when every row has one (no mask, T > 0)."""
    if mask is not None:
        return mask.bool().any(1)
    return x.new_zeros(x.shape[0], dtype=torch.bool) if x.shape[1] == 0 else None


def weighted_mean(values: Tensor, weights: Tensor | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``weights`` (same shape, bool or float) is nonzero.

    No entry (an empty batch, every row padding) gives 0 with a graph, not NaN: an empty batch trains nothing.
    """
    if weights is None:
        return values.mean() if values.numel() else values.sum()
    w = weights.to(values.dtype)
    return (values * w).sum() / w.sum().clamp_min(1.0)


def soft_ranks(logits: Tensor) -> Tensor:
    """1-based soft ranks along the last dim: ``rho_h = 1 + sum_{j != h} sigmoid(logits_j - logits_h)``.

    Equals the hard rank when the logits are far apart; tends to ``(H + 1) / 2`` for every head when they are
    close (a high temperature), which is what makes early training explore.

    >>> soft_ranks(torch.tensor([[100.0, 0.0, -100.0]])).round().tolist()
    [[1.0, 2.0, 3.0]]
    """
    diff = logits.unsqueeze(-2) - logits.unsqueeze(-1)  # (..., H, H): [h, j] = logits_j - logits_h
    return 0.5 + torch.sigmoid(diff).sum(-1)  # the j == h term contributes sigmoid(0) = 0.5


def soft_threshold(s: Tensor, k: Tensor, num_heads: int) -> Tensor:
    """The threshold ``b`` the soft mask compares soft ranks with: value ``k + 1/2``, gradient ``H`` w.r.t. ``s``.

    The value puts the mask's 1/2 crossing halfway between the last kept (rank ``k``) and the first dropped
    (rank ``k + 1``) head, whatever rounding or ``k_min`` clamp produced ``k``; the gradient is that of
    ``s * H`` (straight through the floor of the budget rule), so the task loss can move ``s``.
    """
    sh = s.float() * num_heads
    return k.float() + 0.5 + (sh - sh.detach())


def soft_topk_mask(logits: Tensor, threshold: Tensor, tau: float) -> Tensor:
    """``m_h = sigmoid((b - rho_h) / tau)`` with soft ranks ``rho`` of ``logits (..., H)`` and ``b (...)``."""
    rho = soft_ranks(logits)
    return torch.sigmoid((threshold.unsqueeze(-1) - rho) / tau)


def entropy(probs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean Shannon entropy (nats) of the distributions along the last dim; rows where ``mask`` is False skipped."""
    h = -(probs * torch.log(probs.clamp_min(1e-12))).sum(-1)  # (B,) or (B, T)
    return weighted_mean(h, mask)
