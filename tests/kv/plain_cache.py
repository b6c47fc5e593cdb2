"""A compact cache layer of condcomp's own over a plain storage, and one request to run through it, for the tests
that run the compact path without transformers (test_compact_layer.py, test_compact_call.py)."""

from __future__ import annotations

from typing import Any

import torch
from core_helpers import make_layout, make_weights, random_active
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.kv.layer import CompactLayer
from condcomp.kv.selection import select_kv
from condcomp.types import AttentionInputs

B, P, STEPS, D, H, Hkv, Dh = 3, 5, 3, 16, 4, 2, 4


class Rows:
    """A plain storage layer: keys and values ``(B, g, S, Dh)`` grown along the tokens."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, k: Tensor, v: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 2)
        self.values = v if self.values is None else torch.cat([self.values, v], 2)
        return self.keys, self.values

    def reset(self) -> None:
        self.keys = self.values = None

    def batch_select_indices(self, index: Tensor) -> None:
        assert self.keys is not None and self.values is not None
        self.keys, self.values = self.keys[index], self.values[index]


class Layer(CompactLayer):
    def __init__(self) -> None:
        self.inner = Rows()

    def held_tokens(self) -> int:
        return 0 if self.inner.keys is None else int(self.inner.keys.shape[2])


def request() -> dict[str, Any]:
    """One request of ``B`` rows (row 1 left-padded by 2 tokens) of ``P + STEPS`` tokens, float64, a per-request plan
    keeping 1, 2 and 4 of the ``H`` heads per row: ``layout, w, x, mask, active, plan, sel``."""
    torch.manual_seed(0)
    layout = make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    x = torch.randn(B, P + STEPS, D, dtype=torch.float64)
    mask = torch.ones(B, P + STEPS, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    active = random_active((B, H), torch.tensor([1, 2, 4]))
    plan = condcomp.plan_from_active(active, torch.rand(B, H, dtype=torch.float64) + 0.5)
    return {"layout": layout, "w": w, "x": x, "mask": mask, "active": active, "plan": plan,
            "sel": select_kv(plan, layout)}


def steps() -> list[tuple[int, int]]:
    """The prefill ``(0, P)``, then one token per decode step."""
    return [(0, P)] + [(P + i, P + i + 1) for i in range(STEPS)]


def reference(r: dict[str, Any]) -> Tensor:
    """The per-head reference loop over the whole sequence at once (causal, the padding masked)."""
    S = P + STEPS
    causal = torch.ones(S, S, dtype=torch.bool).tril() & r["mask"][:, None, None, :]  # (B, 1, S, S)
    bias = torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    with torch.no_grad():
        return get_executor("reference")(r["w"], AttentionInputs(x=r["x"], mask=r["mask"], attn_bias=bias),  # type: ignore[no-any-return]
                                         r["plan"])
