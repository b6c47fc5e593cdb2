"""KV-cache decoding of the arch_models architectures against the unwrapped model.

Greedy ``generate()`` (its tokens and every step's logits; left-padded prompts for the causal LMs, a padded encoder
input for T5) must equal the unwrapped model's at the full budget, and the unwrapped model without the skipped
heads' at half budget. GPT-2's cross-attention cache (``add_cross_attention``) is driven by hand like BERT's decoder
in test_hf_adapters.
"""

from __future__ import annotations

import pytest
import torch
from integration_helpers import kept_heads
from torch import Tensor, nn

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
from arch_models import build, reference_with_heads  # noqa: E402
from test_hf_adapters import ATOL, RTOL  # noqa: E402


def _prompt(arch: str) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 100, (2, 5), generator=g)
    mask = torch.ones_like(ids)
    if arch == "t5":
        mask[1, 3:] = 0  # encoder input, right-padded
    else:
        mask[1, :2] = 0  # decoder prompt, left-padded
    return {"input_ids": ids, "attention_mask": mask}


# Mixtral's attention is Mistral's (test_hf_adapters decodes Mistral); its eager experts are slow: two cases only.
CASES = [(arch, executor, fraction) for arch in ("gpt2", "gemma", "qwen3", "t5") for executor in ("masked", "gathered")
         for fraction in (1.0, 0.5)] + [("mixtral", "masked", 1.0), ("mixtral", "gathered", 0.5)]


@pytest.mark.slow
@pytest.mark.parametrize("arch,executor,fraction", CASES)
def test_greedy_generation_through_the_cache_matches_the_unwrapped_model(arch: str, executor: str, fraction: float,
                                                                         prefer_router: str) -> None:
    model = build(arch)
    prompt = _prompt(arch)
    # 6 new tokens: Mixtral's sliding window (4) is exceeded while decoding. No repeated tokens: a tiny random model
    # otherwise tends to repeat one token, and attention over identical values hides position errors.
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, no_repeat_ngram_size=1, output_logits=True,
               return_dict_in_generate=True)
    names = condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}),
                                                           router=prefer_router, executor=executor))
    got = model.generate(**prompt, **gen)
    condcomp.remove_(model)
    ref = model if fraction == 1.0 else reference_with_heads(model, names, kept_heads(4, fraction))
    want = ref.generate(**prompt, **gen)
    assert torch.equal(got.sequences, want.sequences)
    # every decoding step's logits too: tiny random models' argmax alone would hide small errors
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("executor", ["masked", "gathered"])
def test_gpt2_self_and_cross_attention_cache(executor: str, prefer_router: str) -> None:
    from transformers import DynamicCache, EncoderDecoderCache

    model = build("gpt2_cross")
    g = torch.Generator().manual_seed(5)
    ids, enc = torch.randint(2, 100, (2, 6), generator=g), torch.randn(2, 5, 32, generator=g, dtype=torch.float64)

    def cached_logits(m: nn.Module) -> Tensor:
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        first = m(input_ids=ids[:, :4], encoder_hidden_states=enc, cache=cache, use_cache=True).logits
        return torch.cat([first, m(input_ids=ids[:, 4:], encoder_hidden_states=enc, cache=cache,
                                   use_cache=True).logits], 1)

    names = condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=prefer_router,
                                                           executor=executor))
    assert any(n.endswith("crossattention") for n in names)
    got = cached_logits(model)
    condcomp.remove_(model)
    ref = reference_with_heads(model, names, kept_heads(4, 0.5))
    torch.testing.assert_close(got, cached_logits(ref), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, ref(input_ids=ids, encoder_hidden_states=enc).logits, atol=ATOL, rtol=RTOL)
