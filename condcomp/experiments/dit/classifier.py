"""The fixed judge of sample quality: a small classifier trained once on the real training images.

Its penultimate activations are the features of the Fréchet distance (real test images vs generated ones, the
FID recipe with a small in-domain network in place of Inception) and its predictions give the class accuracy of
class-conditional samples. It is trained with a fixed seed and saved, so every run is judged by the same network;
its test accuracy is reported beside the results (a weak judge would make both numbers meaningless).

Digits (one channel) get :class:`DigitsJudge`, an MLP on the 8x8 pixels; other image sets (``--data`` .npz, e.g.
CIFAR-10) get :class:`ConvJudge`, a small CNN.
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

    def __init__(self, features: int = 64, hidden: int = 256, num_classes: int = 10) -> None:
        super().__init__()
        self.width = features
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, features), nn.GELU())
        self.head = nn.Linear(features, num_classes)

    def features(self, images: Tensor) -> Tensor:
        if images.dim() != 4 or images.shape[1] != 1:
            raise ValueError(f"digits judge: images must be (N, 1, S, S), got {tuple(images.shape)}")
        if images.shape[-1] != 8:
            images = nn.functional.adaptive_avg_pool2d(images, 8)
        return self.body(images.clamp(-1, 1).flatten(1))  # (N, 64)

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))


class ConvJudge(nn.Module):
    """A small CNN for ``(N, C, S, S)`` images in [-1, 1]: three conv stages, global average pool -> 128 features."""

    def __init__(self, channels: int, num_classes: int, features: int = 128) -> None:
        super().__init__()
        self.width = features

        def stage(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.GELU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.GELU())

        self.body = nn.Sequential(stage(channels, 32), nn.MaxPool2d(2), stage(32, 64), nn.MaxPool2d(2),
                                  stage(64, features), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(features, num_classes)

    def features(self, images: Tensor) -> Tensor:
        return self.body(images.clamp(-1, 1))  # (N, 128)

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))


Judge = DigitsJudge | ConvJudge


def make_judge(images: Tensor, num_classes: int) -> Judge:
    return DigitsJudge(num_classes=num_classes) if images.shape[1] == 1 else ConvJudge(images.shape[1], num_classes)


def train_judge(images: Tensor, labels: Tensor, seed: int = 0, steps: int = 600, batch: int = 4096) -> Judge:
    """AdamW with light pixel noise (so generated images, never exactly quantised, are in-distribution); full
    batch when the set has at most ``batch`` images (digits), else seeded minibatches of ``batch // 8``."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    judge = make_judge(images, int(labels.max()) + 1).to(images.device)
    opt = torch.optim.AdamW(judge.parameters(), lr=3e-3, weight_decay=1e-2)
    judge.train()
    for _ in range(steps):
        x, y = images, labels
        if images.shape[0] > batch:
            idx = torch.randint(0, images.shape[0], (batch // 8,), generator=g).to(images.device)
            x, y = images[idx], labels[idx]
        noisy = x + 0.05 * torch.randn(x.shape, generator=g).to(x.device)
        loss = nn.functional.cross_entropy(judge(noisy), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return judge.eval()


@torch.no_grad()
def judge_accuracy(judge: Judge, images: Tensor, labels: Tensor) -> float:
    hits = sum(int((judge(x).argmax(1) == y).sum()) for x, y in zip(images.split(1024), labels.split(1024)))
    return hits / max(1, labels.numel())


def load_or_train_judge(path: Path, data: dict[str, tuple[Tensor, Tensor]]) -> tuple[Judge, dict[str, Any]]:
    """The judge saved at ``path`` (trained and saved there first if absent) and its facts (test accuracy)."""
    images, labels = data["train"]
    judge = make_judge(images, int(labels.max()) + 1).to(images.device)
    if path.is_file():
        from condcomp.files import check_state_shapes, read_torch_dict, tensor_dict

        hint = "it belongs to other data? delete it to train it again"
        state = tensor_dict(read_torch_dict(path, "the DiT study's judge (a state dict)", hint), path, "the judge",
                            hint)
        check_state_shapes(path, "the judge", state, judge.state_dict(), hint)
        judge.load_state_dict(state)
        judge.eval()
    else:
        judge = train_judge(images, labels)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(judge.state_dict(), path)
    facts = {"test_accuracy": judge_accuracy(judge, *data["test"]),
             "train_accuracy": judge_accuracy(judge, *data["train"]), "seed": 0, "features": judge.width,
             "kind": type(judge).__name__}
    return judge, facts
