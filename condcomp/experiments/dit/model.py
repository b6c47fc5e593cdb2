"""A small class-conditional Diffusion Transformer (DiT, Peebles & Xie 2023) built on condcomp's HeadAttention.

Patchify (a linear map of each ``p x p`` patch) + fixed 2-D sine-cosine position embeddings, N DiT blocks with
adaLN-Zero conditioning on ``c = timestep embedding + class embedding``, a final adaLN layer and an unpatchify.
Class ``num_classes`` is the null class of classifier-free guidance. Each block's attention is a
:class:`~condcomp.HeadAttention`, so ``condcomp.apply_`` makes it routed (any policy, router, executor); the
block passes ``c`` to it as ``condition=`` so a budget policy that reads the conditioning (``budgetformer_cond``)
sees the noise level. Dense attention ignores it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.attention import HeadAttention
from condcomp.config import dataclass_from_dict


@dataclass
class DiTConfig:
    """Shape of the DiT. ``image_size`` is the side of the square input, ``patch`` the side of a patch."""

    image_size: int = 8
    channels: int = 1
    num_classes: int = 10
    patch: int = 2
    d_model: int = 80
    num_layers: int = 4
    num_heads: int = 20
    mlp_ratio: float = 4.0
    freq_dim: int = 64  # width of the sinusoidal timestep features fed to the timestep MLP

    def __post_init__(self) -> None:
        for name in ("image_size", "channels", "num_classes", "patch", "d_model", "num_layers", "num_heads",
                     "freq_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DiT config: {name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % self.patch:
            raise ValueError(f"DiT config: image_size={self.image_size} is not divisible by patch={self.patch}")
        if self.d_model % self.num_heads:
            raise ValueError(f"DiT config: d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if (self.d_model // 2) % 2 or self.freq_dim % 2:
            raise ValueError("DiT config: d_model must be divisible by 4 and freq_dim by 2 (sine-cosine tables)")

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch) ** 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiTConfig:
        return dataclass_from_dict(cls, d, "DiT config")  # type: ignore[no-any-return]


# Presets (20 heads: 50 %, 75 % and 90 % of them are whole head counts). "digits": minutes on one CPU thread;
# "digits16": the digits upsampled to 16x16 with 64 tokens; "cifar": a DiT-S/2-like shape for 32x32 RGB (GPU).
PRESETS: dict[str, dict[str, Any]] = {
    "digits": {"image_size": 8, "channels": 1, "patch": 2, "d_model": 80, "num_layers": 4, "num_heads": 20},
    "digits16": {"image_size": 16, "channels": 1, "patch": 2, "d_model": 160, "num_layers": 6, "num_heads": 20},
    "cifar": {"image_size": 32, "channels": 3, "patch": 2, "d_model": 400, "num_layers": 12, "num_heads": 20,
              "freq_dim": 256},
}


def sincos_2d(side: int, dim: int) -> Tensor:
    """Fixed 2-D sine-cosine position table ``(side * side, dim)`` (half the width per axis), as in DiT."""
    half = dim // 2
    omega = 1.0 / (10000 ** (torch.arange(half // 2, dtype=torch.float64) / (half / 2)))  # (half/2,)
    coords = torch.arange(side, dtype=torch.float64)
    gy, gx = torch.meshgrid(coords, coords, indexing="ij")

    def axis(pos: Tensor) -> Tensor:
        ang = pos.reshape(-1, 1) * omega  # (side^2, half/2)
        return torch.cat([ang.sin(), ang.cos()], dim=1)

    return torch.cat([axis(gy), axis(gx)], dim=1).float()  # (side^2, dim)


class TimestepEmbedder(nn.Module):
    """``t`` in [0, 1] -> sinusoidal features of ``1000 t`` -> MLP -> ``(B, D)``."""

    def __init__(self, d_model: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        first, second = nn.Linear(freq_dim, d_model), nn.Linear(d_model, d_model)
        for lin in (first, second):
            nn.init.normal_(lin.weight, std=0.02)
        self.mlp = nn.Sequential(first, nn.SiLU(), second)

    def forward(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        ang = (1000.0 * t.float()).unsqueeze(1) * freqs  # (B, half)
        return self.mlp(torch.cat([ang.cos(), ang.sin()], dim=1))  # (B, D)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """adaLN-Zero block: ``x + gate * attn(modulate(LN(x)))``, then the same with the MLP; the six modulation
    vectors come from ``c`` and start at zero, so every block starts as the identity."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        D = cfg.d_model
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = HeadAttention(D, cfg.num_heads)
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        hidden = int(D * cfg.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(D, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, D))
        ada = nn.Linear(D, 6 * D)
        nn.init.zeros_(ada.weight)
        nn.init.zeros_(ada.bias)
        self.ada = nn.Sequential(nn.SiLU(), ada)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        """``x (B, T, D)``, ``c (B, D)``."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=1)  # each (B, D)
        x = x + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift1, scale1), condition=c)
        return x + gate2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        D = cfg.d_model
        self.norm = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        ada = nn.Linear(D, 2 * D)
        self.ada = nn.Sequential(nn.SiLU(), ada)
        self.out = nn.Linear(D, cfg.patch * cfg.patch * cfg.channels)
        for lin in (ada, self.out):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.ada(c).chunk(2, dim=1)
        return self.out(modulate(self.norm(x), shift, scale))  # (B, T, p*p*C)


class DiT(nn.Module):
    """``forward(x (B, C, S, S), t (B,) in [0, 1], y (B,) int64 in 0..num_classes) -> (B, C, S, S)``.

    ``y == num_classes`` is the null label (classifier-free guidance's unconditional branch).

    >>> m = DiT(DiTConfig(d_model=16, num_heads=4, num_layers=1))
    >>> m(torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([3, 10])).shape
    torch.Size([2, 1, 8, 8])
    """

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.config = cfg
        p, C, D = cfg.patch, cfg.channels, cfg.d_model
        self.patch_embed = nn.Linear(p * p * C, D)
        self.register_buffer("pos", sincos_2d(cfg.image_size // p, D), persistent=False)  # (T, D)
        self.t_embed = TimestepEmbedder(D, cfg.freq_dim)
        self.y_embed = nn.Embedding(cfg.num_classes + 1, D)  # the last row is the null label
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.num_layers)])
        self.final = FinalLayer(cfg)
        nn.init.normal_(self.y_embed.weight, std=0.02)

    def patchify(self, x: Tensor) -> Tensor:
        """``(B, C, S, S) -> (B, T, p*p*C)`` in raster order of the patches."""
        B, C, S, _ = x.shape
        p, n = self.config.patch, S // self.config.patch
        return x.reshape(B, C, n, p, n, p).permute(0, 2, 4, 3, 5, 1).reshape(B, n * n, p * p * C)

    def unpatchify(self, tokens: Tensor) -> Tensor:
        B = tokens.shape[0]
        p, C = self.config.patch, self.config.channels
        n = self.config.image_size // p
        return tokens.reshape(B, n, n, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, n * p, n * p)

    def condition(self, t: Tensor, y: Tensor) -> Tensor:
        """The adaLN conditioning vector ``c = t_embed(t) + y_embed(y)`` ``(B, D)``."""
        return self.t_embed(t) + self.y_embed(y)

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        cfg = self.config
        B = x.shape[0]
        if x.dim() != 4 or tuple(x.shape[1:]) != (cfg.channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"DiT: images must be (B, {cfg.channels}, {cfg.image_size}, {cfg.image_size}), "
                             f"got {tuple(x.shape)}")
        if tuple(t.shape) != (B,) or tuple(y.shape) != (B,):
            raise ValueError(f"DiT: t and y must be (B,) = ({B},), got {tuple(t.shape)} and {tuple(y.shape)}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) > cfg.num_classes):
            raise ValueError(f"DiT: labels must lie in 0..{cfg.num_classes} ({cfg.num_classes} = the null label)")
        h = self.patch_embed(self.patchify(x)) + self.pos  # (B, T, D)
        c = self.condition(t, y)  # (B, D)
        for block in self.blocks:
            h = block(h, c)
        return self.unpatchify(self.final(h, c))
