"""condcomp's compact cache layer (``condcomp.kv.layer.CompactLayer``) without transformers: the ``kv_cache``
executor writes a request's kept groups through it (prefill, then decode steps) and the result equals the per-head
reference loop over the whole sequence (causal, left padding, float64); its row operations act on the plan as on
the keys, and a write of every head into a compact layer is refused."""

from __future__ import annotations

import pytest
import torch
from core_helpers import make_layout, make_weights, random_active
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.executors.cached import CompactKV
from condcomp.kv.layer import CompactLayer
from condcomp.kv.selection import HeldPlan, select_kv
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


def test_the_executor_writes_through_the_layer_and_equals_the_reference_and_rows_follow() -> None:
    torch.manual_seed(0)
    layout = make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    S = P + STEPS
    x = torch.randn(B, S, D, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    active = random_active((B, H), torch.tensor([1, 2, 4]))
    plan = condcomp.plan_from_active(active, torch.rand(B, H, dtype=torch.float64) + 0.5)
    sel = select_kv(plan, layout)
    layer, outs = Layer(), []
    for lo, hi in [(0, P)] + [(P + i, P + i + 1) for i in range(STEPS)]:
        compact = CompactKV(sel, layer.store, None, layer.policy_state(), layer.keep_policy_state)
        inputs = AttentionInputs(x=x[:, lo:hi], mask=mask[:, lo:hi], key_mask=mask[:, :hi])
        with torch.no_grad():
            outs.append(get_executor("kv_cache")(w, inputs, plan, cache=compact))
        layer.condcomp_plan = HeldPlan(plan, sel, Hkv)
    causal = torch.ones(S, S, dtype=torch.bool).tril() & mask[:, None, None, :]  # (B, 1, S, S)
    bias = torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    with torch.no_grad():
        ref = get_executor("reference")(w, AttentionInputs(x=x, mask=mask, attn_bias=bias), plan)
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-10, rtol=1e-9)
    kept = int(active.view(B, Hkv, -1).any(-1).sum(-1).max())
    assert layer.inner.keys is not None and layer.inner.keys.shape == (B, kept, S, Dh)  # only the kept groups
    assert not sel.identity  # row 0 keeps one group of two: the layer is compact
    with pytest.raises(ValueError, match="holds only"):  # every head written outside the wrapped model
        layer.update(torch.zeros(B, Hkv, 1, Dh), torch.zeros(B, Hkv, 1, Dh))
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert layer.condcomp_plan is not None and torch.equal(layer.condcomp_plan.plan.active, active[[2, 0]])
    layer.reset()
    assert layer.condcomp_plan is None and layer.held_tokens() == 0
