"""Streamed-group windows inside a quantized KV cache: the codes against a float64 rule, and a full/window split
decoding in an fp8 / 4-bit ``QuantizedCache`` against the same plan whose windows are rounded by that rule."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from condcomp.kv.window_quant import WindowCodec

FP8_MAX = 448.0  # float8 e4m3's largest value


def int_reference(x: torch.Tensor, nbits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dequantized, half step)`` by the rule, in float64: per entry and ``group`` channels, ``2**nbits`` levels
    from the minimum to the maximum, round to nearest."""
    *lead, Dh = x.shape
    xg = x.double().reshape(*lead, Dh // group, group)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    step = (hi - lo) / (2 ** nbits - 1)
    codes = torch.floor((xg - lo) / step + 0.5)
    return (codes * step + lo).reshape(x.shape), (step / 2).expand_as(xg).reshape(x.shape)


def fp8_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.double() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double() * scale


@pytest.mark.parametrize(("nbits", "group"), [(4, 8), (4, 4), (2, 8), (8, 8), (3, 8)])
def test_int_codes_follow_the_rule(nbits: int, group: int) -> None:
    x = torch.randn(2, 3, 7, 8)  # (B, gw, N, Dh)
    codec = WindowCodec("int", nbits=nbits, group=group)
    q = codec.quantize(x)
    want, half = int_reference(x, nbits, group)
    got = codec.dequantize(q)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert bool(((got.double() - x.double()).abs() <= half + 1e-5).all())
    per_byte = 8 // nbits if 8 % nbits == 0 or nbits == 3 else 1
    assert q.codes.numel() == x.numel() // per_byte and q.codes.dtype == torch.uint8  # packed
    assert q.scale.shape == (2, 3, 7, 8 // group)
    again = codec.quantize(got)  # a stored entry quantized again keeps its codes: no drift in the window
    assert torch.equal(again.codes, q.codes)


def test_fp8_codes_keep_the_first_scale() -> None:
    codec = WindowCodec("fp8")
    first = torch.randn(2, 1, 5, 8)
    q = codec.quantize(first)
    scale = first.double().abs().max().item() / FP8_MAX
    torch.testing.assert_close(codec.dequantize(q).double(), fp8_reference(first, scale), rtol=1e-6, atol=1e-7)
    later = 3 * torch.randn(2, 1, 5, 8)  # beyond the frozen range: saturates at +-448 * scale, never NaN
    q2 = codec.quantize(later, like=q)
    assert torch.equal(q2.scale, q.scale)
    torch.testing.assert_close(codec.dequantize(q2).double(), fp8_reference(later, scale), rtol=1e-6, atol=1e-7)
    assert torch.equal(codec.quantize(codec.dequantize(q2), like=q2).codes.view(torch.uint8),
                       q2.codes.view(torch.uint8))


def test_bad_codec_settings_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="'fp8' or 'int'"):
        WindowCodec("int8")
    with pytest.raises(ValueError, match="1 to 8 bits"):
        WindowCodec("int", nbits=16)


def tiny_llama(kv_heads: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=kv_heads, vocab_size=300,
                                      max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


class ReferenceWindows:
    """After every forward, the plan's windows (held unquantized) rounded by the float64 rule: what a quantized
    cache's windows must read back as. fp8 keeps each layer's and tensor's first scale."""

    def __init__(self, kind: str) -> None:
        self.kind, self.scales = kind, {}

    def round(self, cache: Any) -> None:
        from condcomp.kv.window import WindowCache

        for i, layer in enumerate(cache.layers):
            w = layer.__dict__.get("condcomp_windows")
            if w is None:
                continue
            parts = []
            for j, t in enumerate((w.keys, w.values)):
                if self.kind == "fp8":
                    scale = self.scales.setdefault((i, j), t.double().abs().max().item() / FP8_MAX)
                    parts.append(fp8_reference(t, scale).to(t.dtype))
                else:  # hqq4: 4 bits, groups of 64 channels (the tiny model's 8 channels: one group)
                    parts.append(int_reference(t, 4, t.shape[-1])[0].to(t.dtype))
            layer.condcomp_windows = WindowCache(parts[0], parts[1], w.positions, w.seen)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp8", "hqq4"])
@pytest.mark.parametrize(("kv_heads", "fraction"), [(3, 1 / 3), (6, 1 / 3), (3, 0.0)])  # GQA, MHA, all windowed
def test_split_inside_a_quantized_cache_reads_its_windows_quantized(kind: str, kv_heads: int, fraction: float,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.integrations.hf import cache as hf_cache
    from condcomp.integrations.hf import kv_layer

    from condcomp.bench.kv_variants import ModelContext, missing_packages, quantized_cache, window_split
    from condcomp.kv.window_quant import QuantizedWindowCache

    if missing_packages({"fp8": "quantized-fp8", "hqq4": "quantized-hqq4"}[kind]):
        pytest.skip(f"{kind} needs the kvquant extra")
    model = tiny_llama(kv_heads)
    importance = torch.rand(2, kv_heads, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    wrapped = window_split(fraction, window=8, sinks=2)(model, ModelContext(importance=lambda: importance))
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))

    def decode(cache: Any, after: Any) -> tuple[torch.Tensor, Any]:
        logits = []
        with torch.inference_mode():
            out = wrapped(input_ids=ids[:, :32], cache=cache, use_cache=True)  # 32 > sinks + window: evicts
            after(out.cache)
            for t in range(32, 40):
                out = wrapped(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True)
                after(out.cache)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1), out.cache

    got, composed = decode(quantized_cache(kind, model.config), lambda c: None)
    windows = [layer.condcomp_windows for layer in composed.layers]
    assert all(isinstance(w, QuantizedWindowCache) for w in windows)
    B, N = 2, 10  # rows, sinks + window entries
    gw = kv_heads - (0 if fraction == 0 else max(1, round(fraction * kv_heads)))
    code_bytes = B * gw * N * 8 if kind == "fp8" else B * gw * N * 4  # one byte (fp8) or half a byte per value
    side = 2 * 4 if kind == "fp8" else 2 * 2 * B * gw * N * 4  # scales (and zero points) in float32
    assert all(hf_cache.cache_bytes(composed)[i] - _full_bytes(composed.layers[i]) ==
               2 * code_bytes + side + B * N * 8 + B * 8 for i in range(2))  # + positions, seen (int64)
    ref = ReferenceWindows(kind)
    monkeypatch.setattr(kv_layer, "window_codec", lambda layer: None)  # the same plan, windows held unquantized
    want, _ = decode(quantized_cache(kind, model.config), ref.round)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    unrounded, _ = decode(quantized_cache(kind, model.config), lambda c: None)
    assert not torch.allclose(got, unrounded, rtol=0, atol=1e-6)  # the windows' rounding is read


def _full_bytes(layer: Any) -> int:
    """Bytes a quantized layer holds for its own (fully kept) groups: everything but the windows and plan."""
    from condcomp.integrations.hf.cache import cache_bytes

    class One:
        layers = [layer]

    windows = layer.__dict__.pop("condcomp_windows")
    try:
        return cache_bytes(One)[0]
    finally:
        layer.condcomp_windows = windows


@pytest.mark.parametrize("kind", ["fp8", "hqq4"])
@pytest.mark.parametrize("fraction", [1 / 3, 0.0])
def test_converted_prefill_equals_prefilling_the_quantized_cache(kind: str, fraction: float) -> None:
    """The bench shares one prefill between a model's variants (``cache_from_prefill``): with windows, the converted
    cache must read exactly as a prefill made straight into the quantized cache."""
    from condcomp.bench.kv_variants import (
        ModelContext,
        cache_bytes,
        cache_from_prefill,
        missing_packages,
        quantized_cache,
        window_split,
    )

    if missing_packages({"fp8": "quantized-fp8", "hqq4": "quantized-hqq4"}[kind]):
        pytest.skip(f"{kind} needs the kvquant extra")
    model = tiny_llama(3)
    importance = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3]], dtype=torch.float64)
    wrapped = window_split(fraction, window=8, sinks=2)(model, ModelContext(importance=lambda: importance))
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        direct = wrapped(input_ids=ids[:, :32], cache=quantized_cache(kind, model.config), use_cache=True).cache
        source = wrapped(input_ids=ids[:, :32], use_cache=True).cache
        converted = cache_from_prefill(source, kind, model.config)
        assert cache_bytes(converted) == cache_bytes(direct) < cache_bytes(source)
        want = wrapped(input_ids=ids[:, 32:], cache=direct, use_cache=True).logits
        got = wrapped(input_ids=ids[:, 32:], cache=converted, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
