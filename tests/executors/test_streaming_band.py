"""The streaming rule's block-by-block prefill against the rule written out in float64, query by query."""

from __future__ import annotations

import pytest
import torch

from condcomp.dense import grouped_sdpa
from condcomp.kv.window import StreamWindow, band_applies, banded_attention


def rule_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   window: StreamWindow, scale: float | None = None,
                   bias_table: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, head and query: softmax over the keys the rule allows (0 <= j <= p and (j < sinks or p - j <
    window)), float64; padding queries 0. ``bias_table (H, D)``: a score bias by distance ``p - j`` (capped at
    ``D - 1``), T5's kind."""
    B, H, T, Dh = q.shape
    r = H // k.shape[1]
    out = torch.zeros(B, H, T, Dh, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                p = int(pos[b, i])
                if p < 0:
                    continue
                keys = [j for j in range(T) if 0 <= int(pos[b, j]) <= p
                        and (int(pos[b, j]) < window.sinks or p - int(pos[b, j]) < window.window)]
                s = (k[b, h // r, keys].double() @ q[b, h, i].double()) * (Dh ** -0.5 if scale is None else scale)
                if bias_table is not None:
                    cap = bias_table.shape[-1] - 1
                    s = s + bias_table[h, [min(p - int(pos[b, j]), cap) for j in keys]].double()
                out[b, h, i] = torch.softmax(s, 0) @ v[b, h // r, keys].double()
    return out


@pytest.mark.parametrize("sinks,window,T", [(2, 4, 23), (0, 5, 20), (3, 4, 24)])
def test_banded_prefill_equals_the_rule(sinks: int, window: int, T: int) -> None:
    g = torch.Generator().manual_seed(T)
    B, Hkv, r, Dh = 3, 2, 2, 8
    q = torch.randn(B, Hkv * r, T, Dh, generator=g)
    k, v = torch.randn(B, Hkv, T, Dh, generator=g), torch.randn(B, Hkv, T, Dh, generator=g)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :5] = False  # left padding
    real[2, :T - 2] = False  # fewer real tokens than the sinks
    pos = (real.long().cumsum(-1) - 1).masked_fill(~real, -1)
    w = StreamWindow(sinks, window)
    assert band_applies(real, T, w)
    got = banded_attention(q, k, v, pos, w, lambda qb, kb, vb, m: grouped_sdpa(qb, kb, vb, m, False, Dh ** -0.5))
    got = got.masked_fill(~real[:, None, :, None], 0.0)
    torch.testing.assert_close(got.double(), rule_attention(q, k, v, pos, w), atol=1e-5, rtol=1e-5)


def test_band_applies_to_long_left_padded_prefills_only() -> None:
    w = StreamWindow(1, 3)  # capacity 4
    assert not band_applies(None, 8, w) and band_applies(None, 9, w)
    right = torch.ones(2, 12, dtype=torch.bool)
    right[0, -2:] = False  # right padding: real positions are not a band of indices
    assert not band_applies(right, 12, w)


def test_banded_prefill_adds_a_relative_position_bias_at_true_distances() -> None:
    # T5: each query and key get the bias of their real-token distance, table[h, min(p - j, D - 1)], in every block
    from condcomp.kv.position_bias import RelativeBias

    g = torch.Generator().manual_seed(5)
    B, H, T, Dh, D = 2, 2, 21, 8, 6
    q, k, v = (torch.randn(B, H, T, Dh, generator=g) for _ in range(3))
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :4] = False  # left padding
    pos = (real.long().cumsum(-1) - 1).masked_fill(~real, -1)
    table = torch.randn(1, H, D, generator=g) * 3
    w = StreamWindow(2, 4)
    bias = RelativeBias(table).for_heads(torch.arange(H).expand(B, H))
    got = banded_attention(q, k, v, pos, w, lambda qb, kb, vb, m: grouped_sdpa(qb, kb, vb, m, False, 1.0), bias)
    want = rule_attention(q, k, v, pos, w, scale=1.0, bias_table=table[0])
    got = got.masked_fill(~real[:, None, :, None], 0.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
