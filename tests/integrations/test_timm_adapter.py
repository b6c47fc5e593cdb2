"""timm VisionTransformer attention x every executor against the unwrapped model (run by .ci/timm.sh)."""

from __future__ import annotations

import copy

import pytest
import torch
from integration_helpers import kept_heads, state_equal, zero_heads_
from torch import nn

import condcomp

timm = pytest.importorskip("timm", reason="timm is not installed (it needs torchvision; see .ci/timm.sh)")

EXECUTORS = condcomp.list_executors()


def vit(fused: bool) -> nn.Module:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8,
                              depth=2, num_heads=4, embed_dim=32)
    for block in model.blocks:
        block.attn.fused_attn = fused
    return model.double().eval()


def images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_full_budget_parity_and_exact_remove(executor: str, fused: bool) -> None:
    model, x = vit(fused), images()
    want = model(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor=executor))
    assert names == ["blocks.0.attn", "blocks.1.attn"]
    torch.testing.assert_close(model(x), want, atol=1e-10, rtol=1e-9)
    condcomp.remove_(model)
    assert torch.equal(model(x), want) and state_equal(model.state_dict(), before)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_partial_budget_equals_unwrapped_model_without_the_skipped_heads(executor: str, prefer_router: str) -> None:
    model, x = vit(True), images()
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router, executor=executor)
    names = condcomp.apply_(model, cfg)
    got = model(x)
    condcomp.remove_(model)
    ref = copy.deepcopy(model)
    for name in names:
        zero_heads_(ref.get_submodule(name).proj, kept_heads(4, 0.5), 8)
    torch.testing.assert_close(got, ref(x), atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("fused", [True, False])
def test_masks_and_is_causal_reach_the_routed_attention(fused: bool) -> None:
    attn = vit(fused).blocks[0].attn
    holder = nn.Sequential()
    holder.add_module("attn", attn)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    bool_mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    bool_mask[1, :, :, 4:] = False  # the last two tokens of example 1 are padding
    float_mask = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    cases = [{"attn_mask": bool_mask}, {"attn_mask": float_mask}, {"is_causal": True}]
    wants = [attn(x, **kw) for kw in cases]
    condcomp.apply_(holder, condcomp.CondCompConfig(policy="full", router="random", executor="reference"))
    for kw, want in zip(cases, wants):
        torch.testing.assert_close(holder.attn(x, **kw), want, atol=1e-10, rtol=1e-9)


def test_qk_norm_is_refused_with_the_reason() -> None:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              num_heads=4, embed_dim=32, qk_norm=True)
    with pytest.raises(ValueError, match="q_norm"):
        condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random"))
