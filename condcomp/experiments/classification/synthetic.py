"""The embedded default task: synthetic classification whose difficulty varies per example by construction.

Vocabulary (C classes): 0 = padding, then C cue tokens, C "A" value tokens, C "B" value tokens, then noise.

- **easy** example of class c: noise tokens plus one cue token ``CUE_c``. One position decides the label; the
  mean-pooled embeddings separate the classes linearly, so no attention is needed at all.
- **hard** example: noise tokens plus ``A_a`` and ``B_b`` at random positions; label = (a + b) mod C. Neither
  token alone says anything about the label (each class is equally likely given one of them), and the model's
  only cross-position operations are attention and a *linear* head on the pooled sequence, so the model must let
  the two positions interact through attention.

Lengths vary between ``seq_len // 2`` and ``seq_len`` (padding is exercised). Every example is tagged
``"easy"`` or ``"hard"``; a model whose budget adapts to difficulty should give hard examples more heads.
"""

from __future__ import annotations

import torch

from condcomp.experiments.classification.batches import EncodedSplit


def synthetic_vocab_size(num_classes: int = 4, num_noise: int = 48) -> int:
    """Vocabulary size of :func:`make_synthetic` for these settings."""
    return 1 + 3 * num_classes + num_noise


def make_synthetic(n: int, seq_len: int = 24, num_classes: int = 4, hard_fraction: float = 0.5,
                   num_noise: int = 48, seed: int = 0) -> EncodedSplit:
    """``n`` examples of the easy/hard task (deterministic in ``seed``).

    >>> s = make_synthetic(8, seed=1); (len(s), s.ids.shape[1], sorted(set(s.tags)) <= ["easy", "hard"])
    (8, 24, True)
    """
    if n < 1 or seq_len < 4 or num_classes < 2 or not 0.0 <= hard_fraction <= 1.0:
        raise ValueError(f"make_synthetic: need n >= 1, seq_len >= 4, num_classes >= 2, 0 <= hard_fraction <= 1; "
                         f"got n={n}, seq_len={seq_len}, num_classes={num_classes}, hard_fraction={hard_fraction}")
    g = torch.Generator().manual_seed(seed)
    C = num_classes
    cue0, a0, b0, noise0 = 1, 1 + C, 1 + 2 * C, 1 + 3 * C
    lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)  # (N,)
    ids = torch.randint(noise0, noise0 + num_noise, (n, seq_len), generator=g)  # (N, T)
    mask = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)  # (N, T)
    ids = ids.masked_fill(~mask, 0)
    hard = torch.rand(n, generator=g) < hard_fraction  # (N,)
    a = torch.randint(0, C, (n,), generator=g)
    b = torch.randint(0, C, (n,), generator=g)
    labels = torch.where(hard, (a + b) % C, a)  # easy examples use a as their class
    # Two distinct positions inside each example's real length.
    u = torch.rand(n, generator=g)
    v = torch.rand(n, generator=g)
    p1 = (u * lengths).long().clamp_max(lengths - 1)
    p2 = (p1 + 1 + (v * (lengths - 1)).long()) % lengths
    rows = torch.arange(n)
    ids[rows, p1] = torch.where(hard, a0 + a, cue0 + a)
    ids[rows[hard], p2[hard]] = b0 + b[hard]
    tags = ["hard" if h else "easy" for h in hard.tolist()]
    info = {"dataset": "synthetic", "num_classes": C, "seq_len": seq_len, "hard_fraction": hard_fraction}
    return EncodedSplit(ids, mask, labels, None, tags, info)
