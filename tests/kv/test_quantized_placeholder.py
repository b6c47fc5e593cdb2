"""Every group streamed inside an HQQ 4-bit cache with a prompt that is not a multiple of 64 tokens (red team
issue 41, item 8: HQQ's raw AssertionError). The full-length tensor then only counts tokens; in a layer that
quantizes in groups of 64 values it is 64 wide, so it quantizes at any length, and reading it changes nothing:
the logits equal the same plan on a dynamic cache whose windows are stored with the same 4-bit codes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from condcomp.bench.kv_variants import missing_packages, quantized_cache
from condcomp.kv.calibration import static_split
from condcomp.kv.window_quant import QuantizedWindowCache, WindowCodec

t = pytest.importorskip("transformers")
P, STEPS = 41, 92  # 41 + 92 = 133 tokens: past the HQQ layer's 128 full-precision residual tokens


def streaming_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=192, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
                           num_key_value_heads=3, vocab_size=300, head_dim=64)
    model = t.LlamaForCausalLM(config).eval()
    return static_split(model, torch.rand(2, 3, dtype=torch.float64), 0.0, window=8, sinks=2)  # every group streams


def decode(model: torch.nn.Module, cache: Any, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    logits = []
    with torch.inference_mode():
        out = model(input_ids=ids[:, :P], past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        for i in range(P, P + STEPS):
            out = model(input_ids=ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), out.past_key_values


def test_every_group_streamed_in_an_hqq4_cache_at_any_prompt_length(monkeypatch: pytest.MonkeyPatch) -> None:
    if missing_packages("quantized-hqq4"):
        pytest.skip("hqq4 needs the kvquant extra")
    from condcomp.integrations.hf import kv_layer

    model = streaming_llama()
    ids = torch.randint(0, 300, (2, P + STEPS), generator=torch.Generator().manual_seed(1))
    got, cache = decode(model, quantized_cache("hqq4", model.config), ids)
    assert all(isinstance(layer.condcomp_windows, QuantizedWindowCache) for layer in cache.layers)
    monkeypatch.setattr(kv_layer, "window_codec", lambda layer: WindowCodec("int", nbits=4, group=64))
    want, dynamic = decode(model, t.DynamicCache(), ids)
    assert all(layer.keys.shape[-1] == 1 for layer in dynamic.layers)  # a dynamic layer's placeholder: width 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
