"""A request's compact cache in a static cache: storage allocated once for the kept groups, the token count held on
the device (what a compiled decode step needs), against independent references: the reference executor without a
cache (decode_helpers.reference_logits) and sizes counted by hand from the plans."""

from __future__ import annotations

import pytest
import torch
from condcomp.integrations.hf.cache import cache_bytes
from decode_helpers import TOL, extend, llama, prompts, reference_logits, step, t, wrap

import condcomp

MAX_LEN = 16


def _decode(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, cache: object, steps: int
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill then ``steps`` greedy tokens; ``mask`` None: no attention mask passed at all (unpadded rows)."""
    grown = torch.ones_like(ids) if mask is None else mask
    tokens, logits = ids, []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(grown.cumsum(-1) - 1).clamp_min(0),
                    past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            logits.append(out)
            tokens, grown = extend(tokens, grown, out.argmax(-1, keepdim=True))
            if mask is None:
                pos = torch.full((ids.shape[0], 1), tokens.shape[1] - 1)
                out = model(input_ids=tokens[:, -1:], position_ids=pos, past_key_values=cache,
                            use_cache=True).logits[:, -1]
            else:
                out = step(model, tokens, grown, cache, 1)
    logits.append(out)
    return tokens, logits


def test_a_static_layer_holds_the_kept_groups_and_counts_tokens_on_the_device() -> None:
    model = wrap(llama(kv_heads=8), fraction=1 / 3)
    ids, mask = prompts()
    cache = t.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    _decode(model, ids, mask, cache, 2)
    plans = condcomp.request_plans(model, cache)
    B, Dh = ids.shape[0], 64 // 8
    for i, layer in enumerate(cache.layers):
        kept = max(len(groups) for groups in plans[f"model.layers.{i}.self_attn"].kept_kv_groups())
        assert kept < 8  # the plan keeps a part of the groups: the pool is compact
        assert tuple(layer.keys.shape) == (B, kept, MAX_LEN, Dh)  # preallocated for the kept groups only
        held = layer.held_position()
        assert isinstance(held, torch.Tensor) and held is layer.inner.cumulative_length
        assert int(held) == ids.shape[1] + 2
        assert "condcomp_tokens" not in layer.__dict__ and layer.is_compileable
    # bytes by hand: keys + values of the kept groups, float32, and the int64 token count
    want = [2 * B * int(layer.keys.shape[1]) * MAX_LEN * Dh * 4 + 8 for layer in cache.layers]
    assert cache_bytes(cache) == want


@pytest.mark.parametrize("fraction", [1 / 3, 1.0])
@pytest.mark.parametrize("padded", [True, False])
def test_static_decoding_with_the_device_count_equals_the_reference(fraction: float, padded: bool) -> None:
    """Padded rows (transformers' mask) and no mask at all (the pool read whole, its unwritten positions masked)."""
    model = wrap(llama(kv_heads=8), fraction=fraction)
    ids, mask = prompts() if padded else (prompts()[0], None)
    tokens, logits = _decode(model, ids, mask, t.StaticCache(config=model.config, max_cache_len=MAX_LEN), 3)
    want = reference_logits(model, tokens, torch.ones_like(ids) if mask is None else mask)
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, ids.shape[1] - 1 + i], **TOL)


def test_reset_drops_the_plan_and_the_next_request_decides_its_own() -> None:
    model = wrap(llama(kv_heads=8), fraction=1 / 3)
    first, _ = prompts(seed=11)
    cache = t.StaticCache(config=model.config, max_cache_len=MAX_LEN)  # allocated for a batch: reused at its size
    _decode(model, first, None, cache, 1)
    cache.reset()
    ids, mask = prompts()
    assert condcomp.request_plans(model, cache) == {}
    tokens, logits = _decode(model, ids, mask, cache, 2)
    want = reference_logits(model, tokens, mask)
    torch.testing.assert_close(logits[-1], want[:, -1], **TOL)
