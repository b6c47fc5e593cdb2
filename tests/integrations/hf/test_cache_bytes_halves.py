"""``cache_bytes`` counts every tensor a cache holds: both halves of T5's ``EncoderDecoderCache`` (red team round 5,
item 3: the cross-attention keys and values were left out).

Oracles, independent of the code under test: the storages walked by hand (every key and value tensor of both
halves, each storage once, ``numel * element_size``), and the same number from the shapes alone (batch x heads x
tokens x head width x 8 bytes, keys and values, decoder tokens for self-attention, encoder tokens for cross).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from arch_models import batch, build

t = pytest.importorskip("transformers")


def _t5_cache() -> Any:
    model = build("t5")
    with torch.no_grad():
        out = model(**batch("t5"), use_cache=True)
    return out.past_key_values


def _by_hand(cache: Any) -> list[int]:
    """Each layer: the distinct storages of its self- and cross-attention keys and values, in bytes."""
    counts = []
    halves = [cache.self_attention_cache, cache.cross_attention_cache]
    for i in range(len(halves[0].layers)):
        seen: dict[int, int] = {}
        for half in halves:
            layer = half.layers[i]
            for tensor in (layer.keys, layer.values):
                seen[tensor.untyped_storage().data_ptr()] = tensor.numel() * tensor.element_size()
        counts.append(sum(seen.values()))
    return counts


def test_an_encoder_decoder_cache_counts_both_halves() -> None:
    from condcomp.integrations.hf.cache import cache_bytes

    from condcomp.bench.kv_variants import cache_bytes as total_bytes

    cache = _t5_cache()
    assert type(cache).__name__ == "EncoderDecoderCache"
    inputs = batch("t5")
    B, T_enc = inputs["input_ids"].shape
    T_dec = inputs["decoder_input_ids"].shape[1]
    H, Dh = 4, 8  # build("t5"): num_heads=4, d_kv=8, float64
    from_shapes = 2 * B * H * Dh * 8 * (T_dec + T_enc)  # keys and values of both halves, per layer
    assert _by_hand(cache) == [from_shapes, from_shapes]
    assert cache_bytes(cache) == _by_hand(cache)
    assert total_bytes(cache) == 2 * from_shapes
    cross_only = 2 * B * H * Dh * 8 * T_enc
    assert cache_bytes(cache.self_attention_cache) == [from_shapes - cross_only] * 2  # one half: that half alone
