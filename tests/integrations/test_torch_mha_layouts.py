"""nn.MultiheadAttention layouts beyond tests/integrations/test_torch_mha.py: unbatched masks, decoder layers (self- and
cross-attention), separate q/k/v weights without bias, 3-D bool masks, and partial budgets against the unwrapped
module with the skipped heads' output columns zeroed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from core_helpers import Holder
from integration_helpers import kept_heads, zero_heads_
from torch import Tensor, nn

import condcomp

D, H, T, S = 16, 4, 5, 6


def case(name: str) -> tuple[dict[str, Any], tuple[Tensor, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    if name == "unbatched_key_padding":
        pad = torch.zeros(T, dtype=torch.bool)
        pad[3:] = True
        return {}, (x, x, x), {"key_padding_mask": pad}
    if name == "unbatched_per_head_mask":
        return {}, (x, x, x), {"attn_mask": torch.randn(H, T, T, generator=g, dtype=torch.float64)}
    xb = torch.randn(2, T, D, generator=g, dtype=torch.float64)
    if name == "bool_3d_mask":
        m = torch.rand(2 * H, T, T, generator=g) < 0.4
        m[:, torch.arange(T), torch.arange(T)] = False  # every query keeps itself
        return {"batch_first": True}, (xb, xb, xb), {"attn_mask": m}
    if name == "separate_weights_no_bias":
        mem = torch.randn(2, S, 12, generator=g, dtype=torch.float64)
        val = torch.randn(2, S, 10, generator=g, dtype=torch.float64)
        return {"batch_first": True, "kdim": 12, "vdim": 10, "bias": False}, (xb, mem, val), {}
    raise KeyError(name)


CASES = ["unbatched_key_padding", "unbatched_per_head_mask", "bool_3d_mask", "separate_weights_no_bias"]


@pytest.mark.parametrize("executor", condcomp.list_executors())
@pytest.mark.parametrize("name", CASES)
def test_layout_full_budget_parity_and_partial_budget_reference(name: str, executor: str,
                                                                prefer_router: str) -> None:
    opts, args, kw = case(name)
    model = Holder(**opts).double().eval()
    want = model(*args, **kw)
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor=executor))
    torch.testing.assert_close(model(*args, **kw), want, atol=1e-10, rtol=1e-9)
    condcomp.remove_(model)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router,
                                                   executor=executor))
    got = model(*args, **kw)
    condcomp.remove_(model)
    ref = copy.deepcopy(model)
    zero_heads_(ref.attn.out_proj, kept_heads(H, 0.5), D // H)
    torch.testing.assert_close(got, ref(*args, **kw), atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_decoder_layer_self_and_cross_attention(batch_first: bool) -> None:
    layer = nn.TransformerDecoderLayer(D, H, dim_feedforward=24, dropout=0.0, batch_first=batch_first)
    layer = layer.double().eval()
    g = torch.Generator().manual_seed(1)
    tgt = torch.randn(2, T, D, generator=g, dtype=torch.float64)
    mem = torch.randn(2, S, D, generator=g, dtype=torch.float64)
    if not batch_first:
        tgt, mem = tgt.transpose(0, 1), mem.transpose(0, 1)
    mem_pad = torch.zeros(2, S, dtype=torch.bool)
    mem_pad[1, 4:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    kw = {"tgt_mask": causal, "tgt_is_causal": True, "memory_key_padding_mask": mem_pad}
    want = layer(tgt, mem, **kw)
    names = condcomp.apply_(layer, condcomp.CondCompConfig(policy="full", router="random"))
    assert names == ["self_attn", "multihead_attn"]
    torch.testing.assert_close(layer(tgt, mem, **kw), want, atol=1e-10, rtol=1e-9)
    condcomp.remove_(layer)
    assert torch.equal(layer(tgt, mem, **kw), want)
