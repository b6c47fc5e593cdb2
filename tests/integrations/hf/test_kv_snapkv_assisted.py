"""Assisted and prompt-lookup decoding with ``kv="snapkv"`` and ``kv="adakv"`` (its selection is SnapKV's, shared
across a request's groups) (red team round 5). Oracle: the same wrapped model's
plain greedy decoding (assisted greedy decoding must give exactly its tokens).

Before: the first call (the prompt and the first candidates) was compressed as if the candidates were prompt, with
the candidates as the observation window, so when every candidate was accepted the tokens differed silently; a
rejected one was refused ("cannot crop into the prompt"); and a verifier's call of several tokens right after a
prefill was refused as a second prompt chunk."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from decode_helpers import gpt2, llama
from torch import nn

import condcomp

t = pytest.importorskip("transformers")

SNAP = ("snapkv", {"budget": 2, "observe": 2, "pool": 1})
ADA = ("adakv", {"budget": 2, "observe": 2, "pool": 1, "floor": 0.5})
SELECTING = pytest.mark.parametrize("kv", [SNAP, ADA], ids=["snapkv", "adakv"])


def snapkv_model(seed: int = 0, kv_heads: int = 8, kv: Any = SNAP) -> nn.Module:
    model = llama(kv_heads, seed=seed)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}), kv=kv))
    return model.eval()


def drafting(assistant: nn.Module) -> nn.Module:
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0  # draft every candidate, however unsure
    return assistant


def greedy_pair(model: nn.Module, ids: torch.Tensor, **assisted: Any) -> tuple[torch.Tensor, torch.Tensor]:
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                              do_sample=False, pad_token_id=0)
    with condcomp.plan_from_prompt(model, ids.shape[1]):
        return model.generate(**kw), model.generate(**kw, **assisted)


@SELECTING
@pytest.mark.parametrize("seed", [0, 3])
def test_an_assistant_whose_candidates_are_all_accepted_gives_plain_greedy_decodings_tokens(seed: int, kv: Any) -> None:
    model = snapkv_model(seed, kv=kv)
    assistant = drafting(copy.deepcopy(model))  # drafts the model's own greedy tokens: every candidate accepted
    ids = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(seed))
    with condcomp.plan_from_prompt(assistant, ids.shape[1]):
        want, got = greedy_pair(model, ids, assistant_model=assistant)
    assert torch.equal(got, want)


@SELECTING
def test_an_assistant_whose_candidates_are_rejected_gives_plain_greedy_decodings_tokens(kv: Any) -> None:
    model = snapkv_model(kv=kv)
    ids = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(1))
    want, got = greedy_pair(model, ids, assistant_model=drafting(llama(8, seed=1)))
    assert torch.equal(got, want)


@SELECTING
def test_prompt_lookup_drafting_after_a_first_round_without_candidates(kv: Any) -> None:
    model = snapkv_model(kv_heads=4, kv=kv)
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(9))[:10].unsqueeze(0) + 1  # the first token
    want, got = greedy_pair(model, ids, prompt_lookup_num_tokens=3)  # repeats a prompt token: drafted after it
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv", [SNAP, ("window", {"sinks": 1, "window": 3})])
def test_gpt2_assisted_decoding_past_the_window_gives_plain_greedy_decodings_tokens(kv: Any) -> None:
    """GPT-2 holds KV policies through the same decoder sequence: its first round (an 8-token prompt past a 1 + 3
    window, three candidates) is taken back as the Llama family's is."""
    model = gpt2()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk", kv=kv))
    model.eval()
    ids = torch.randint(1, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    want, got = greedy_pair(model, ids, assistant_model=drafting(gpt2(seed=1)))
    assert torch.equal(got, want)

