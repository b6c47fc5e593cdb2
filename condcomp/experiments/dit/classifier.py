"""The fixed judge of sample quality: a small digits classifier trained once on the real training images.

Its penultimate activations are the features of the Fréchet distance (real test images vs generated ones, the
FID recipe with a digits network in place of Inception) and its predictions give the class accuracy of
class-conditional samples. It is trained with a fixed seed and saved, so every run is judged by the same network;
its test accuracy is reported beside the results (a weak judge would make both numbers meaningless).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


class DigitsJudge(nn.Module):
    """``(N, 1, S, S)`` images in [-1, 1] -> logits; ``features`` gives the 64-wide penultimate activations.

    Images larger than 8x8 are area-averaged down to 8x8 first, so one judge serves every preset on digits.
    """

    def __init__(self, features: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, features), nn.GELU())
        self.head = nn.Linear(features, 10)

    def features(self, images: Tensor) -> Tensor:
        if images.dim() != 4 or images.shape[1] != 1:
            raise ValueError(f"digits judge: images must be (N, 1, S, S), got {tuple(images.shape)}")
        if images.shape[-1] != 8:
            images = nn.functional.adaptive_avg_pool2d(images, 8)
        return self.body(images.clamp(-1, 1).flatten(1))  # (N, 64)

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))


def train_judge(images: Tensor, labels: Tensor, seed: int = 0, steps: int = 600) -> DigitsJudge:
    """Full-batch AdamW with light pixel noise (so generated images, never exactly 4-bit, are in-distribution)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    judge = DigitsJudge()
    opt = torch.optim.AdamW(judge.parameters(), lr=3e-3, weight_decay=1e-2)
    for _ in range(steps):
        noisy = images + 0.05 * torch.randn(images.shape, generator=g)
        loss = nn.functional.cross_entropy(judge(noisy), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return judge.eval()


@torch.no_grad()
def judge_accuracy(judge: DigitsJudge, images: Tensor, labels: Tensor) -> float:
    return float((judge(images).argmax(1) == labels).float().mean())


def load_or_train_judge(path: Path, data: dict[str, tuple[Tensor, Tensor]]) -> tuple[DigitsJudge, dict[str, Any]]:
    """The judge saved at ``path`` (trained and saved there first if absent) and its facts (test accuracy)."""
    judge = DigitsJudge()
    if path.is_file():
        try:
            judge.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except (RuntimeError, OSError, ValueError) as err:
            raise RuntimeError(f"digits judge {path} cannot be loaded ({err}); delete it to train it again") from None
        judge.eval()
    else:
        judge = train_judge(*data["train"])
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(judge.state_dict(), path)
    facts = {"test_accuracy": judge_accuracy(judge, *data["test"]),
             "train_accuracy": judge_accuracy(judge, *data["train"]), "seed": 0, "features": 64}
    return judge, facts
