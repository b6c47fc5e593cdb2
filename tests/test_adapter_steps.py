"""The steps adapters share (condcomp.masks, condcomp.dense, RoutedAttention.attend_parts), each against a loop or the
call it replaces."""

from __future__ import annotations

import torch
from torch import nn

import condcomp
from condcomp.dense import split_heads
from condcomp.masks import additive_bias, attended_keys, causal_bias


def test_causal_bias_is_bottom_right_aligned_and_additive() -> None:
    T, S = 3, 5
    bias = causal_bias(T, S, torch.device("cpu"), torch.float64)
    assert bias.shape == (1, 1, T, S) and bias.dtype == torch.float64
    for i in range(T):
        for j in range(S):
            assert bias[0, 0, i, j].item() == (0.0 if j <= i + S - T else float("-inf"))


def test_additive_bias_and_attended_keys_from_a_bool_mask() -> None:
    allowed = torch.tensor([[True, False, True], [False, False, True]])  # (B=2, S=3) broadcast over H and T
    bias = additive_bias(allowed, torch.float32)
    assert bias.tolist() == [[0.0, float("-inf"), 0.0], [float("-inf"), float("-inf"), 0.0]]
    four_d = torch.zeros(2, 1, 4, 3, dtype=torch.bool)
    four_d[0, 0, 1, 0] = four_d[1, 0, 3, 2] = True  # one query of each row may attend one key
    assert attended_keys(four_d, 2, 3).tolist() == [[True, False, False], [False, False, True]]
    assert attended_keys(torch.tensor([True, False, True]), 2, 3).tolist() == [[True, False, True]] * 2


def test_split_heads_normalises_each_head_then_rotates() -> None:
    B, S, H, Dh = 2, 4, 3, 6
    t = torch.randn(B, S, H * Dh, dtype=torch.float64)
    norm = nn.RMSNorm(Dh, dtype=torch.float64)
    nn.init.normal_(norm.weight)
    cos, sin = torch.randn(1, S, Dh, dtype=torch.float64), torch.randn(1, S, Dh, dtype=torch.float64)
    got = split_heads(t, Dh, norm, (cos, sin))
    for h in range(H):  # per head: slice its columns, normalise, rotate half
        head = norm(t[..., h * Dh:(h + 1) * Dh])  # (B, S, Dh)
        rotated = torch.cat([-head[..., Dh // 2:], head[..., :Dh // 2]], dim=-1)
        torch.testing.assert_close(got[:, h], head * cos + rotated * sin)


def test_attend_parts_drops_attention_only_in_training() -> None:
    layer = condcomp.HeadAttention(16, 4, dropout=0.5)
    routed = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(policy="full", router="random"))
    x = torch.randn(2, 5, 16)
    routed.eval()
    torch.testing.assert_close(routed.attend_parts(x), routed.attend(condcomp.AttentionInputs(x=x)))
    routed.train()
    torch.manual_seed(3)
    dropped = routed.attend_parts(x)
    torch.manual_seed(3)
    torch.testing.assert_close(dropped, routed.attend(condcomp.AttentionInputs(x=x, dropout_p=0.5)))
    assert not torch.allclose(dropped, routed.attend(condcomp.AttentionInputs(x=x)))
