"""The reference encoder classifier: embeddings, N pre-norm layers of HeadAttention + FFN, pooling, classifier.

Built dense; ``condcomp.apply_(model, CondCompConfig(...))`` makes every layer's attention routed (the standard
Transformer is the same model with the ``full`` policy). Pre-norm (LayerNorm before attention and FFN, one final
LayerNorm) because it trains stably from scratch with the short schedules the presets use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.attention import HeadAttention
from condcomp.config import dataclass_from_dict


@dataclass
class ModelConfig:
    """Shape of the encoder classifier. ``pooling``: ``"mean"`` over real tokens or ``"cls"`` (first token)."""

    vocab_size: int
    num_classes: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 8
    d_ff: int = 256
    max_len: int = 128
    num_segments: int = 1
    dropout: float = 0.1
    pooling: str = "mean"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_classes", "d_model", "num_layers", "num_heads", "d_ff", "max_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_classes < 2:
            raise ValueError(f"model config: num_classes must be >= 2, got {self.num_classes}")
        if self.d_model % self.num_heads:
            raise ValueError(f"model config: d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"model config: pooling must be 'mean' or 'cls', got {self.pooling!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return dataclass_from_dict(cls, d, "model config")  # type: ignore[no-any-return]


# Presets: shapes only (vocab and classes come from the data). "paper" is BudgetFormer's reported encoder;
# "medium" keeps its depth and head count (4 x 8) at d = 256, which still trains on a CPU in minutes.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_len": 32},
    "small": {"d_model": 128, "num_layers": 2, "num_heads": 8, "d_ff": 256, "max_len": 128},
    "medium": {"d_model": 256, "num_layers": 4, "num_heads": 8, "d_ff": 1024, "max_len": 128},
    "paper": {"d_model": 768, "num_layers": 4, "num_heads": 8, "d_ff": 3072, "max_len": 256},
}


def preset(name: str, **overrides: Any) -> dict[str, Any]:
    """A preset's shape fields, with ``overrides`` applied (None values are ignored)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    out = dict(PRESETS[name])
    out.update({k: v for k, v in overrides.items() if v is not None})
    return out


class EncoderLayer(nn.Module):
    """Pre-norm: x + attn(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = HeadAttention(cfg.d_model, cfg.num_heads)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ffn = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), mask=mask))
        return x + self.drop(self.ffn(self.norm2(x)))


class EncoderClassifier(nn.Module):
    """Token + position (+ segment) embeddings -> encoder layers -> pooling -> linear classifier.

    >>> m = EncoderClassifier(ModelConfig(vocab_size=50, num_classes=3, d_model=16, num_heads=2, d_ff=32))
    >>> ids = torch.randint(1, 50, (2, 7)); m(ids, ids != 0).shape
    torch.Size([2, 3])
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.seg = nn.Embedding(cfg.num_segments, cfg.d_model) if cfg.num_segments > 1 else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids: Tensor, mask: Tensor, segments: Tensor | None = None) -> Tensor:
        """``ids (B, T)`` int64, ``mask (B, T)`` bool True = real token, ``segments (B, T)`` or None -> logits."""
        B, T = ids.shape
        if tuple(mask.shape) != (B, T) or (segments is not None and tuple(segments.shape) != (B, T)):
            got = f"mask {tuple(mask.shape)}" + ("" if segments is None else f", segments {tuple(segments.shape)}")
            raise ValueError(f"mask and segments must have the shape of ids {(B, T)}, got {got}")
        if T > self.config.max_len:
            raise ValueError(f"sequence length {T} exceeds the model's max_len={self.config.max_len}; "
                             "truncate the inputs (--max-len) or build the model with a larger max_len")
        positions = torch.arange(T, device=ids.device)
        x = self.tok(ids) + self.pos(positions)  # (B, T, D)
        if self.seg is not None and segments is not None:
            x = x + self.seg(segments)
        x = self.drop(x)
        mask = mask.bool()
        for layer in self.layers:
            x = layer(x, mask)
        x = self.norm(x)
        if self.config.pooling == "cls":
            pooled = x[:, 0]
        else:
            w = mask.unsqueeze(-1).to(x.dtype)  # (B, T, 1)
            pooled = (x * w).sum(1) / w.sum(1).clamp_min(1.0)
        return self.head(pooled)  # (B, C)
