"""snapkv / adakv token state inside an fp8 / HQQ 4-bit ``QuantizedCache``: stored by the quantizer's own rule.

The same plan decoded on the same quantized cache with the state held unquantized and rounded after every forward
by the rule written here in float64 (fp8 e4m3 with each layer's first scale frozen; 4-bit round-to-nearest per
entry over its channels) gives the same logits; without the rounding they differ (the codes are read). The bytes
are a hand count of codes, scales and the exact positions and counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import condcomp

t = pytest.importorskip("transformers")
FP8_MAX = 448.0
P, STEPS = 20, 6


def fp8_rule(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.double() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double() * scale


def int4_rule(x: torch.Tensor) -> torch.Tensor:
    """4 bits per entry over all its channels (the tiny model's 8 channels are one of HQQ's 64-channel groups)."""
    xd = x.double()
    lo, hi = xd.amin(-1, keepdim=True), xd.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    return torch.floor((xd - lo) / step + 0.5) * step + lo


class RuleRounding:
    """After every forward: each layer's token state (held unquantized) rounded by the float64 rule."""

    def __init__(self, kind: str) -> None:
        self.kind, self.scales = kind, {}

    def __call__(self, cache: Any) -> None:
        import dataclasses

        for i, layer in enumerate(cache.layers):
            s = layer.__dict__.get("condcomp_windows")
            if s is None:
                continue
            parts = []
            for j, x in enumerate((s.keys, s.values)):
                if self.kind == "fp8":
                    scale = self.scales.setdefault((i, j), x.double().abs().max().item() / FP8_MAX)
                    parts.append(fp8_rule(x, scale).to(x.dtype))
                else:
                    parts.append(int4_rule(x).to(x.dtype))
            layer.condcomp_windows = dataclasses.replace(s, keys=parts[0], values=parts[1])


def model_with(kv: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=3, vocab_size=300, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = t.LlamaForCausalLM(config).eval()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}),
                                                   kv=(kv, {"budget": 6, "observe": 2, "pool": 3})))
    return model.eval()


@pytest.mark.parametrize("kind", ["fp8", "hqq4"])
@pytest.mark.parametrize("kv", ["snapkv", "adakv"])
def test_token_state_in_a_quantized_cache_follows_the_quantizers_rule(kind: str, kv: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.integrations.hf import kv_layer
    from condcomp.integrations.hf.cache import cache_bytes

    from condcomp.bench.kv_variants import missing_packages, quantized_cache
    from condcomp.kv.snap_quant import QuantizedSnapState

    if missing_packages({"fp8": "quantized-fp8", "hqq4": "quantized-hqq4"}[kind]):
        pytest.skip(f"{kind} needs the kvquant extra")
    model = model_with(kv)
    ids = torch.randint(0, 300, (2, P + STEPS), generator=torch.Generator().manual_seed(2))

    def decode(after: Any) -> tuple[torch.Tensor, Any]:
        cache, logits = quantized_cache(kind, model.config), []
        with torch.inference_mode():
            out = model(input_ids=ids[:, :P], cache=cache, use_cache=True)
            after(out.cache)
            for i in range(P, P + STEPS):
                out = model(input_ids=ids[:, i:i + 1], cache=out.cache, use_cache=True)
                after(out.cache)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1), out.cache

    got, cache = decode(lambda c: None)
    states = [layer.condcomp_windows for layer in cache.layers]
    assert states and all(isinstance(s, QuantizedSnapState) for s in states)
    for layer, nbytes, s in zip(cache.layers, cache_bytes(cache), states):
        B, gw, N = s.positions.shape
        codes = B * gw * N * 8 * (1 if kind == "fp8" else 0.5)  # one byte (fp8) or half a byte per value
        side = 2 * 4 if kind == "fp8" else 2 * 2 * B * gw * N * 4  # scales (and zero points): float32
        state = 2 * codes + side + B * gw * N * 8 + 2 * B * 8  # + positions, seen and prompt (int64)
        layer.__dict__.pop("condcomp_windows")
        try:
            assert nbytes - cache_bytes(type("One", (), {"layers": [layer]}))[0] == state
        finally:
            layer.condcomp_windows = s
    for layer, s in zip(cache.layers, states):  # a verifier's rollback (the quantized layers cannot crop their own
        # keys in transformers): the last two tokens' entries emptied, every code kept as it was
        c = layer.condcomp_plan.selection.policy.crop(s, 2)
        assert isinstance(c, QuantizedSnapState) and torch.equal(c.keys.codes.view(torch.uint8),
                                                                 s.keys.codes.view(torch.uint8))
        assert torch.equal(c.seen, s.seen - 2) and torch.equal(c.positions, s.positions.masked_fill(
            s.positions >= (s.seen - 2)[:, None, None], -1))
    monkeypatch.setattr(kv_layer, "window_codec", lambda layer: None)  # the same plan, the state unquantized
    want, _ = decode(RuleRounding(kind))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    unrounded, _ = decode(lambda c: None)
    assert not torch.allclose(got, unrounded, rtol=0, atol=1e-6)  # the state's rounding is read


def test_an_empty_first_store_does_not_freeze_the_fp8_scale() -> None:
    # a state that holds no token at its first store (a group keeping 0 prompt tokens) has no range to calibrate on:
    # the scale comes from the first store that holds tokens, by the rule (amax / 448), then stays frozen
    from condcomp.kv.window_quant import WindowCodec

    codec = WindowCodec("fp8")
    empty = codec.quantize(torch.zeros(2, 1, 0, 8))
    x = torch.randn(2, 1, 3, 8, generator=torch.Generator().manual_seed(0)) * 5
    first = codec.quantize(x, empty)
    scale = float(x.abs().max()) / FP8_MAX
    torch.testing.assert_close(codec.dequantize(first).double(), fp8_rule(x, scale), atol=1e-6, rtol=0)
    later = codec.quantize(x * 0.5, first)  # frozen: the first real store's scale
    torch.testing.assert_close(codec.dequantize(later).double(), fp8_rule(x * 0.5, scale), atol=1e-6, rtol=0)
