"""Flow-matching training objective and an Euler sampler with classifier-free guidance.

Flow matching with the linear (rectified-flow) path, chosen over DDPM because it samples well in a few dozen
deterministic steps (the sampler is then a plain ODE solve: reproducible, and cheap enough on a CPU):

- ``x_t = (1 - t) x_0 + t eps`` with ``t ~ U(0, 1)``, ``eps ~ N(0, I)``; the model predicts the velocity
  ``v = eps - x_0`` under a mean squared error. ``t`` is the noise level: 0 = data, 1 = pure noise.
- Labels are replaced by the null label with probability ``label_drop`` (0.1), so one network is both the
  conditional and the unconditional model.
- Sampling integrates ``dx/dt = v`` from ``t = 1`` to 0 in ``steps`` Euler steps with the guided velocity
  ``v_u + w (v_c - v_u)`` (``w = guidance``; 1 = no guidance), both branches in one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def flow_matching_loss(model: nn.Module, x0: Tensor, y: Tensor, generator: torch.Generator,
                       label_drop: float = 0.1) -> tuple[Tensor, Tensor]:
    """Mean squared velocity error on a batch ``x0 (B, C, S, S)``, labels ``y (B,)``; returns ``(loss, t)``."""
    B = x0.shape[0]
    num_classes: int = model.config.num_classes  # type: ignore[union-attr,assignment]
    t = torch.rand(B, generator=generator).to(x0.device)  # (B,)
    eps = torch.randn(x0.shape, generator=generator).to(x0.device)
    drop = torch.rand(B, generator=generator).to(x0.device) < label_drop
    y = y.masked_fill(drop, num_classes)
    tt = t.view(B, 1, 1, 1)
    xt = (1 - tt) * x0 + tt * eps
    v = model(xt, t, y)
    return ((v - (eps - x0)) ** 2).mean(), t


StepHook = Callable[[int, float], None]


@torch.no_grad()
def sample(model: nn.Module, labels: Tensor, steps: int = 25, guidance: float = 2.0, seed: int = 0,
           on_step: StepHook | None = None) -> Tensor:
    """Class-conditional samples ``(N, C, S, S)`` for ``labels (N,)``, deterministic for a given ``seed``.

    ``on_step(i, t)`` is called after the model's forward at step ``i`` (noise level ``t``), e.g. to read
    ``condcomp.head_usage(model)`` per noise level. The batch holds both guidance branches (2N rows) unless
    ``guidance == 1``.
    """
    cfg: Any = model.config
    if steps < 1:
        raise ValueError(f"sample: steps must be >= 1, got {steps}")
    if labels.dim() != 1 or (labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= cfg.num_classes)):
        raise ValueError(f"sample: labels must be a 1-D tensor of classes in 0..{cfg.num_classes - 1}")
    device = next(model.parameters()).device
    labels = labels.to(device)
    N = labels.shape[0]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((N, cfg.channels, cfg.image_size, cfg.image_size), generator=g).to(device)
    guided = guidance != 1.0
    y = torch.cat([labels, torch.full_like(labels, cfg.num_classes)]) if guided else labels
    ts = torch.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        t, t_next = float(ts[i]), float(ts[i + 1])
        xin = torch.cat([x, x]) if guided else x
        v = model(xin, torch.full((xin.shape[0],), t, device=device), y)
        if on_step is not None:
            on_step(i, t)
        if guided:
            v_c, v_u = v.chunk(2)
            v = v_u + guidance * (v_c - v_u)
        x = x + (t_next - t) * v
    return x
