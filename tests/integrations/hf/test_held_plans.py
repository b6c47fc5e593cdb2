"""Per-request plans on causal LMs: decided at prefill, held across decode steps, KV cache of kept groups only.

The reference is independent of the cache path: the reference executor (per-head loop) run over the whole
sequence in one forward without a cache, with the plan decided from the prompt (``plan_from_prompt``), and
the dense model's own cache for the cached keys and values.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import condcomp

t = pytest.importorskip("transformers")

P, NEW = 6, 5  # prompt width (left-padded), greedy steps after the prefill


def _llama(kv_heads: int, heads: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, vocab_size=97, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return t.LlamaForCausalLM(config).eval()


def _wrapped(kv_heads: int, fraction: float, kv_groups: bool, executor: str = "auto") -> nn.Module:
    model = _llama(kv_heads)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}),
                                  router=("topk", {"kv_groups": kv_groups}), executor=executor)
    condcomp.apply_(model, cfg)
    return model.eval()


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (3, P), generator=g)
    mask = torch.ones(3, P, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    mask[2, :4] = 0
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


@torch.no_grad()
def _decode(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], object]:
    """Prefill + NEW greedy steps with a DynamicCache; (all tokens, per-step last logits, cache)."""
    cache = t.DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), past_key_values=cache,
                use_cache=True)
    logits = [out.logits[:, -1]]
    tokens = ids
    for _ in range(NEW):
        nxt = logits[-1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out = model(input_ids=nxt, attention_mask=mask, position_ids=_positions(mask)[:, -1:], past_key_values=cache,
                    use_cache=True)
        logits.append(out.logits[:, -1])
    return tokens, logits, cache


@torch.no_grad()
def _reference_logits(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One cache-free forward over prompt + continuation, reference executor, plan from the prompt only."""
    ref = copy.deepcopy(model)
    for m in condcomp.api.routed_modules(ref).values():
        m.executor = "reference"
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], tokens.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with condcomp.plan_from_prompt(ref, P):
        out = ref(input_ids=tokens, attention_mask=full_mask, position_ids=_positions(full_mask), use_cache=False)
    return out.logits[:, P - 1:]  # (B, NEW + 1, V): the logits each decode step predicted from


def _kept_groups(model: nn.Module, cache: object) -> list[torch.Tensor]:
    return [m.held_plan(cache)[1].kv_index for m in condcomp.api.routed_modules(model).values()]  # type: ignore[index]


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads, fraction, kv_groups", [
    (2, 0.5, True),    # GQA, whole groups: one of two KV groups per row
    (4, 0.25, False),  # GQA, single heads: a group is kept when any of its heads is
    (8, 0.25, True),   # MHA: two of eight heads (= KV heads) per row
])
def test_held_plans_decode_equals_the_reference_run_without_a_cache(kv_heads: int, fraction: float,
                                                                     kv_groups: bool) -> None:
    model = _wrapped(kv_heads, fraction, kv_groups)
    ids, mask = _prompts()
    tokens, logits, cache = _decode(model, ids, mask)
    want = _reference_logits(model, tokens, mask)
    for step, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, step], atol=1e-4, rtol=1e-4, msg=f"decode step {step}")
    kept = _kept_groups(model, cache)
    assert any(len({tuple(row.tolist()) for row in k}) > 1 for k in kept), "rows should keep different groups"
    # the cache holds the kept groups only: g slots, not every KV head
    for layer, k in zip(cache.layers, kept):  # type: ignore[attr-defined]
        assert layer.keys.shape[1] == k.shape[1] < kv_heads
        assert layer.keys.shape[2] == P + NEW


def test_cached_keys_are_the_dense_models_keys_of_the_kept_groups() -> None:
    model = _wrapped(4, 0.5, True)
    ids, mask = _prompts()
    tokens, _, cache = _decode(model, ids, mask)
    dense_cache = t.DynamicCache()
    full_mask = torch.cat([mask, torch.ones(3, NEW, dtype=mask.dtype)], 1)
    with torch.no_grad(), condcomp.disabled(model):
        model(input_ids=tokens, attention_mask=full_mask, position_ids=_positions(full_mask),
              past_key_values=dense_cache, use_cache=True)
    # layer 0 only: its input is the embeddings in both models (deeper layers see routed outputs)
    ours, dense = cache.layers[0], dense_cache.layers[0]  # type: ignore[attr-defined]
    sel = next(iter(condcomp.api.routed_modules(model).values())).held_plan(cache)[1]  # type: ignore[index]
    assert ours.keys.shape[1] == sel.slots < 4
    for b in range(3):
        kept = int(sel.slot_gates[b].view(sel.slots, -1).any(-1).sum())  # real (not spare) slots
        groups = sel.kv_index[b, :kept]
        real = full_mask[b].bool()  # padded positions hold unused values in both caches
        torch.testing.assert_close(ours.keys[b, :kept][:, real], dense.keys[b, groups][:, real], atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(ours.values[b, :kept][:, real], dense.values[b, groups][:, real], atol=1e-5,
                                   rtol=1e-5)


def test_the_plan_is_decided_once_per_request_and_held() -> None:
    model = _wrapped(2, 0.5, True)
    calls = []
    for m in condcomp.api.routed_modules(model).values():
        m.condcomp_router.register_forward_hook(lambda *_: calls.append(1))
    ids, mask = _prompts()
    _, _, cache = _decode(model, ids, mask)
    assert len(calls) == 2  # two layers, routed at the prefill only
    first = _kept_groups(model, cache)
    _, _, cache2 = _decode(model, ids.flip(1), mask)  # a new request (new cache) is routed again
    assert len(calls) == 4
    assert _kept_groups(model, cache) == first  # the first request's plan is unchanged


@pytest.mark.slow
def test_generate_with_a_per_request_budget_matches_greedy_reference_decoding() -> None:
    model = _wrapped(2, 0.5, True)
    ids, mask = _prompts()
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    # independent greedy decoding: a cache-free reference forward over everything so far, every step
    tokens = ids
    for _ in range(NEW):
        nxt = _reference_logits(model, tokens, mask)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
    assert torch.equal(got, tokens)


def test_full_budget_generate_is_token_identical_to_dense() -> None:
    dense = _llama(2)
    wrapped = copy.deepcopy(dense)
    condcomp.apply_(wrapped, condcomp.CondCompConfig(policy="full", router="topk"))
    ids, mask = _prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(wrapped.eval().generate(**kw), dense.generate(**kw))
    held = [m.held_plan for m in condcomp.api.routed_modules(wrapped).values()]
    assert held  # (each call of generate decided and dropped its own plan with its cache)


def test_per_token_plans_keep_every_kv_head_in_the_cache() -> None:
    model = _llama(2)
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router=("moh", {"shared_heads": 2, "top_k": 2})))
    ids, mask = _prompts()
    tokens, logits, cache = _decode(model.eval(), ids, mask)
    assert all(layer.keys.shape[1] == 2 for layer in cache.layers)  # type: ignore[attr-defined]
    ref = copy.deepcopy(model)
    for m in condcomp.api.routed_modules(ref).values():
        m.executor = "reference"
    full_mask = torch.cat([mask, torch.ones(3, NEW, dtype=mask.dtype)], 1)
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=full_mask, position_ids=_positions(full_mask)).logits[:, P - 1:]
    for step, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, step], atol=1e-4, rtol=1e-4)


def test_a_cache_filled_without_a_held_plan_is_refused() -> None:
    model = _wrapped(2, 0.5, True)
    ids, mask = _prompts()
    cache = t.DynamicCache()
    with torch.no_grad():
        with condcomp.disabled(model):
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="did not decide a plan"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


def test_a_wrapped_model_pickles_after_generating() -> None:
    model = _wrapped(2, 0.5, True)
    ids, mask = _prompts()
    _, logits, cache = _decode(model, ids, mask)
    again = pickle.loads(pickle.dumps(model))
    _, logits2, _ = _decode(again, ids, mask)
    torch.testing.assert_close(logits2[-1], logits[-1], atol=0, rtol=0)
    assert cache is not None


@pytest.mark.slow
def test_beam_search_with_held_plans_matches_the_dense_model_at_full_budget_and_runs_at_half() -> None:
    dense = _llama(2)
    wrapped = copy.deepcopy(dense)
    condcomp.apply_(wrapped, condcomp.CondCompConfig(policy="full", router="topk"))
    ids, mask = _prompts()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(wrapped.eval().generate(**kw), dense.generate(**kw))
    half = _wrapped(2, 0.5, True)
    out = half.generate(**kw, return_dict_in_generate=True)
    assert out.sequences.shape == (3, P + 4)
    assert all(layer.keys.shape[1] == 1 for layer in out.past_key_values.layers)  # one of two KV groups per row


def test_gpt2_holds_the_request_plan_and_caches_only_its_kept_heads() -> None:
    """GPT-2 (fused c_attn) runs the base decoder sequence too: the request's plan is held across decode steps and
    its compact cache holds the kept heads only (2 of 4 at half budget)."""
    torch.manual_seed(0)
    model = t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64)).eval()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk"))
    ids, mask = _prompts()
    tokens, logits, cache = _decode(model, ids, mask)
    want = _reference_logits(model, tokens, mask)
    for step, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, step], atol=1e-4, rtol=1e-4, msg=f"decode step {step}")
    assert all(layer.keys.shape[1] == 2 for layer in cache.layers)  # type: ignore[attr-defined]


def test_a_plan_with_no_heads_outputs_zero_attention_and_caches_one_slot() -> None:
    """k_min = 0 and a zero budget: one key/value slot per row is cached (so the cache counts the request's
    tokens; its gate is 0), and decoding equals the reference."""
    model = _llama(2)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.0, "k_min": 0}),
                                                   router=("topk", {"kv_groups": True})))
    ids, mask = _prompts()
    tokens, logits, cache = _decode(model.eval(), ids, mask)
    assert all(layer.keys.shape[1] == 1 for layer in cache.layers)  # type: ignore[attr-defined]
    assert cache.get_seq_length() == tokens.shape[1]  # type: ignore[attr-defined]
    want = _reference_logits(model, tokens, mask)
    for step, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, step], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_held_plans_with_peft_lora_equal_the_reference_and_bf16_full_budget_equals_dense() -> None:
    peft = pytest.importorskip("peft")
    model = _wrapped(2, 0.5, True)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, lora).eval()
    ids, mask = _prompts()
    tokens, logits, _ = _decode(model, ids, mask)
    want = _reference_logits(model, tokens, mask)
    for step, got in enumerate(logits):
        torch.testing.assert_close(got, want[:, step], atol=1e-4, rtol=1e-4)
    dense = _llama(2).to(torch.bfloat16)
    wrapped = copy.deepcopy(dense)
    condcomp.apply_(wrapped, condcomp.CondCompConfig(policy="full", router="topk"))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(wrapped.eval().generate(**kw), dense.generate(**kw))
