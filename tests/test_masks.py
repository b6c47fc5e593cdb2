"""Masks of a dtype the attention cannot read exactly are refused, as torch refuses them; none is reinterpreted.

Reference: what ``nn.MultiheadAttention`` itself does with the same mask (it raises), and for the in-place edit of a
transformers mask, the unwrapped model given the edited mask.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import condcomp


def _mha() -> tuple[nn.MultiheadAttention, nn.MultiheadAttention]:
    ref = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    model = nn.Sequential(nn.MultiheadAttention(16, 4, batch_first=True)).eval()
    model[0].load_state_dict(ref.state_dict())
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random"))
    return ref, model[0]


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
@pytest.mark.parametrize("which", ["key_padding_mask", "attn_mask"])
def test_integer_masks_are_refused_like_torch(which: str, dtype: torch.dtype) -> None:
    ref, routed = _mha()
    x = torch.randn(2, 3, 16)
    mask = torch.zeros((2, 3) if which == "key_padding_mask" else (3, 3), dtype=dtype)
    with pytest.raises(AssertionError, match="only bool and floating"):
        ref(x, x, x, **{which: mask})
    with pytest.raises(TypeError, match=f"only bool and floating types of {which}"):
        routed(x, x, x, **{which: mask})


def test_bool_and_float_masks_still_match_torch() -> None:
    ref, routed = _mha()
    x = torch.randn(2, 3, 16)
    kpm = torch.tensor([[False, False, True], [False, False, False]])
    for kw in ({"key_padding_mask": kpm}, {"key_padding_mask": torch.zeros(2, 3).masked_fill(kpm, float("-inf"))},
               {"attn_mask": torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)}):
        with torch.no_grad():
            torch.testing.assert_close(routed(x, x, x, **kw)[0], ref(x, x, x, need_weights=False, **kw)[0])


def test_a_float_padding_mask_is_refused_by_head_attention() -> None:
    """``mask`` means True = real token; an additive float mask (0 / -inf) read as bool would be inverted."""
    model = nn.Sequential(condcomp.HeadAttention(16, 4))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random"))
    additive = torch.zeros(2, 3).masked_fill(torch.tensor([[False, False, True], [False] * 3]), float("-inf"))
    with pytest.raises(TypeError, match="padding mask must be bool"):
        model[0](torch.randn(2, 3, 16), additive)


def test_transformers_4d_integer_mask_is_refused_and_in_place_edits_are_seen() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=8,
                                  vocab_size=50, attn_implementation="sdpa")
    ref = transformers.BertModel(cfg).eval()
    model = transformers.BertModel(cfg).eval()
    model.load_state_dict(ref.state_dict())
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor="masked"))
    hidden = torch.randn(2, 4, 16)
    layer, ref_layer = model.encoder.layer[0].attention, ref.encoder.layer[0].attention
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(layer(hidden, attention_mask=mask)[0], ref_layer(hidden, attention_mask=mask)[0])
        mask[1, :, :, 2:] = False  # edited in place: same tensor object
        torch.testing.assert_close(layer(hidden, attention_mask=mask)[0], ref_layer(hidden, attention_mask=mask)[0])
        with pytest.raises(TypeError, match="only bool and floating types"):
            layer(hidden, attention_mask=mask.long())
