"""The ``snapkv`` KV policy on the ``kv_cache`` executor against its rule written from scratch in float64: which
prompt tokens each (row, KV group) keeps (the last ``observe`` prompt queries' attention summed over the group's
heads, average-pooled over ``pool`` tokens, the ``budget`` best plus the window), and the attention over them at
every later step. MHA and GQA, left padding, rows with different plans, prefill then decode, row selection, crop."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.executors.cached import CompactKV
from condcomp.kv import SnapKV, select_kv
from condcomp.types import AttentionInputs, AttentionWeights

sys_path = __import__("sys").path
sys_path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
import snapkv_rule  # noqa: E402
from core_helpers import make_layout, make_weights, random_active  # noqa: E402
from flops_by_hand import flop_frac_by_hand  # noqa: E402
from list_cache import ListCache, prefill_then_steps  # noqa: E402

B, P, STEPS, D, H, Dh = 3, 12, 4, 16, 4, 4
POLICY = SnapKV(budget=3, observe=2, pool=3)


def padding() -> Tensor:
    mask = torch.ones(B, P + STEPS, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    mask[2, :7] = False  # 5 real prompt tokens: fewer than budget + observe + pool's reach
    return mask


def kept_by_rule(w: AttentionWeights, x: Tensor, mask: Tensor, b: int, g: int) -> set[int]:
    """The sequence indices of the prompt tokens row ``b``'s group ``g`` keeps, from scratch in float64."""
    real = [i for i in range(P) if mask[b, i]]
    obs, prefix = real[-POLICY.observe:], real[:-POLICY.observe]
    pooled = snapkv_rule.pooled_scores(w, x[b], real, g, POLICY.observe, prefix, POLICY.pool)
    best = sorted(prefix, key=lambda j: -pooled[j])[:POLICY.budget]
    return set(best) | set(obs)


def rule_bias(w: AttentionWeights, x: Tensor, mask: Tensor, snap: Tensor) -> Tensor:
    """``(B, H, S, S)`` float64: causal over real tokens; a snapkv group's heads after the prompt also only over
    its kept prompt tokens."""
    return snapkv_rule.kept_prompt_bias(mask, snap, lambda b, g: kept_by_rule(w, x, mask, b, g), P, H,
                                        w.layout.group_size)


@pytest.mark.parametrize("Hkv", [4, 2])
@pytest.mark.parametrize("ks", [[0, 2, 4], [2, 1, 3]])
def test_snapkv_prefill_and_decode_equal_the_rule_from_scratch(Hkv: int, ks: list[int]) -> None:
    torch.manual_seed(Hkv * 10 + sum(ks))
    layout = make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    w = AttentionWeights(layout, w.q_weight, w.k_weight, w.v_weight, w.o_weight)  # no biases: the rule's q.k
    x = torch.randn(B, P + STEPS, D, dtype=torch.float64)
    mask = padding()
    active = random_active((B, H), torch.tensor(ks))
    plan = condcomp.plan_from_active(active)
    sel = select_kv(plan, layout, POLICY)
    y, cache = prefill_then_steps(w, x, mask, plan, sel, P)
    with torch.no_grad():
        snap = ~active.view(B, Hkv, -1).any(-1)  # (B, Hkv): the groups the plan does not keep
        heads = active | snap.repeat_interleave(H // Hkv, 1)
        ref = get_executor("reference")(w, AttentionInputs(x=x, mask=mask, attn_bias=rule_bias(w, x, mask, snap)),
                                        condcomp.plan_from_active(heads))
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-9)
    state = cache.windows
    assert state is not None and state.keys.shape[2] == POLICY.budget + POLICY.observe + STEPS  # bytes by hand
    assert sum(t.numel() * t.element_size() for t in POLICY.tensors(state)) == (
        2 * B * int(snap.sum(-1).max()) * (POLICY.budget + POLICY.observe + STEPS) * Dh * 8
        + B * int(snap.sum(-1).max()) * (POLICY.budget + POLICY.observe + STEPS) * 8 + 2 * B * 8)


def test_snapkv_rows_crop_and_options() -> None:
    from condcomp.kv.snapkv import SnapState

    state = SnapState(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), torch.tensor([[[0, 5, 6]], [[1, 2, -1]]]),
                      torch.tensor([7, 3]), torch.tensor([6, 3]))
    rows = POLICY.take_rows(state, torch.tensor([1, 1, 0]))
    assert rows.positions[:, 0].tolist() == [[1, 2, -1], [1, 2, -1], [0, 5, 6]] and rows.seen.tolist() == [3, 3, 7]
    cropped = POLICY.crop(SnapState(state.keys[:1], state.values[:1], state.positions[:1], state.seen[:1],
                                    state.prompt[:1]), 1)
    assert cropped.positions.tolist() == [[[0, 5, -1]]] and cropped.seen.tolist() == [6]
    with pytest.raises(ValueError, match="cannot crop 2 token"):
        POLICY.crop(state, 2)  # row 0 would lose a prompt token
    with pytest.raises(ValueError, match="pool must be odd"):
        SnapKV(pool=4)
    with pytest.raises(ValueError, match=r"snapkv kv policy: observe .* must be a whole number >= 1"):
        condcomp.CondCompConfig(kv=("snapkv", {"observe": 0}))


@pytest.mark.parametrize("policy", ["snapkv", "adakv"])
def test_token_selection_on_a_llama_keeping_the_whole_prompt_decodes_as_the_unwrapped_model(policy: str) -> None:
    # whole-group plans + a budget larger than any prompt: every token is kept, every head computed: the dense model
    t = pytest.importorskip("transformers")
    from condcomp.integrations.hf.cache import cache_bytes

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=50)
        return t.LlamaForCausalLM(config).eval()

    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    model = llama()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}),
                                                   kv=(policy, {"budget": 16, "observe": 2, "pool": 3})))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    got = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    want = llama().generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    plans = condcomp.request_plans(model, got.past_key_values)
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == {"full", policy}
    assert all(n > 0 for n in cache_bytes(got.past_key_values))


def test_snapkv_refuses_a_prompt_prefilled_in_chunks() -> None:
    # the second chunk of a prompt arrives before any generated token (seen == prompt) with several tokens
    from condcomp.kv.snapkv import SnapState

    state = SnapState(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.tensor([[[0, 4, 5]]]),
                      torch.tensor([6]), torch.tensor([6]), prefill_only=True)
    q, k, v = torch.randn(1, 2, 4, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="prefilled in one call"):
        POLICY.attend(q, k, v, state, None, 0.5, True)
    # after a verifier's crop (assisted decoding crops 0 when a round had no candidates), several tokens are a
    # verifier's call, not a chunk
    verified = POLICY.attend(q, k, v, POLICY.crop(state, 0), None, 0.5, True)[2]
    assert verified.seen.tolist() == [10]
    out, _, after = POLICY.attend(q[:, :, :1], k[:, :, :1], v[:, :, :1], state, None, 0.5, True)  # a decode step
    assert out.shape == (1, 2, 1, 4) and after.seen.tolist() == [7]


@pytest.mark.parametrize("kv", ["snapkv", "adakv"])
def test_head_usage_counts_a_decode_steps_held_heads_over_the_entries_they_read(kv: str) -> None:
    """At a decode step a snapkv (adakv) group's heads read the kept prompt entries (padded ones computed too) and
    the new token, not every key: ``flop_frac`` matches FLOPs counted by hand per head (q, scores, values, output
    per query row; key/value projections per cached group, as for a streamed window) over the dense block's."""
    pytest.importorskip("transformers")
    from condcomp.integrations.hf.cache import cache_layer


    sys_path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "integrations" / "hf"))
    from decode_helpers import extend, llama, prompts, step

    model = llama(4)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}),
                                                   kv=(kv, {"budget": 2, "observe": 2, "pool": 3})))
    model.eval()
    ids, mask = prompts()
    cache = __import__("transformers").DynamicCache()
    logits = step(model, ids, mask, cache, ids.shape[1])
    tokens, mask = extend(ids, mask, logits.argmax(-1, keepdim=True))
    step(model, tokens, mask, cache, 1)
    T, S = 1, tokens.shape[1]
    usage = condcomp.head_usage(model)
    for i, (name, plan) in enumerate(condcomp.request_plans(model, cache).items()):
        assert plan.kv_modes is not None
        full, held = (plan.kv_modes == 2).sum(-1), (plan.kv_modes == 1).sum(-1)  # groups per row
        n = cache_layer(cache, i).condcomp_windows.keys.shape[2]  # entries after the step: read by the step
        assert n < S
        routed = condcomp.api.routed_modules(model)[name]
        want = flop_frac_by_hand(model.config, routed, full, held, T, S, n)
        assert usage[name].flop_frac == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("kv", ["snapkv", "adakv"])
def test_spare_slots_hold_no_tokens_so_the_state_is_padded_to_the_held_groups_only(kv: str) -> None:
    # red team round 6: row 0 (12 real tokens) keeps every group in full, row 1 (5 real tokens) keeps group 0 and
    # leaves group 1 to the policy, which keeps all 5 prompt tokens (fraction 1.0). Row 0's slot is spare: it used
    # to choose 12 tokens of its own, padding the state to 12 entries per slot. Hand count: 5 entries, then 6.
    from condcomp.kv import AdaKV

    policy = (SnapKV if kv == "snapkv" else AdaKV)(fraction=1.0, observe=2, pool=1)
    torch.manual_seed(0)
    layout = make_layout(H=4, Hkv=2, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    w = AttentionWeights(layout, w.q_weight, w.k_weight, w.v_weight, w.o_weight)
    x = torch.randn(2, 13, D, dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :7] = False  # left padding: 5 real prompt tokens
    active = torch.tensor([[True, True, True, True], [True, False, False, False]])
    plan = condcomp.plan_from_active(active)
    sel = select_kv(plan, layout, policy)
    cache, outs = ListCache(), []
    ex = get_executor("kv_cache")
    with torch.no_grad():
        for lo, hi in [(0, 12), (12, 13)]:
            compact = CompactKV(sel, cache.store, None, cache.windows, cache.keep)
            inputs = AttentionInputs(x=x[:, lo:hi], mask=mask[:, lo:hi], key_mask=mask[:, :hi], kv_cache=compact)
            outs.append(ex(w, inputs, plan))
            state = cache.windows
            assert state is not None and [p for p in state.positions[1, 0].tolist() if p >= 0] == list(range(hi - 7))
            assert tuple(state.keys.shape) == (2, 1, hi - 7, Dh)  # row 0's spare slot holds nothing
            assert (state.positions[0] == -1).all() or hi == 13 and state.positions[0].ge(0).sum() == 1
        # every prompt token kept: row 1's group 1 attends like a full group at gate 1 (head 1 of its kept group 0
        # stays skipped): the reference executor on those heads, no cache
        heads = torch.tensor([[True, True, True, True], [True, False, True, True]])
        ref = get_executor("reference")(w, AttentionInputs(x=x, mask=mask, key_mask=mask),
                                        condcomp.plan_from_active(heads))
    torch.testing.assert_close(torch.cat(outs, 1)[1, 7:], ref[1, 7:], atol=1e-10, rtol=1e-9)


def test_a_fraction_of_the_prompt_is_exact_when_the_product_is_whole() -> None:
    # red team round 6: 0.29 x 100 is 28.999999999999996 in float64; a bare floor kept 28 tokens per group, not the
    # 29 that 29/100 of 100 tokens is (integer arithmetic: Fraction)
    from fractions import Fraction

    from condcomp.kv import AdaKV
    from condcomp.kv.snapkv import prompt_budgets

    for f in (0.29, 0.57, 0.58, 0.14, 0.5):
        for n in (50, 100, 1000):
            want = int(Fraction(str(f)) * n) - 4
            assert prompt_budgets(torch.tensor([n]), torch.tensor([4]), None, f).tolist() == [want], (f, n)
    # adakv's floor share: 0.29 of a 100-token budget is 29 of each group's own; group 1 scores higher everywhere,
    # so it takes the rest of the layer's 200
    scores = torch.cat([torch.full((1, 1, 300), 0.1), torch.full((1, 1, 300), 0.9)], 1)  # (1, 2, 300)
    chosen = AdaKV(budget=100, floor=0.29)._choose(scores, torch.tensor([100]), torch.tensor([[True, True]]))
    assert chosen.sum(-1).tolist() == [[29, 171]]


@pytest.mark.parametrize("policy", ["snapkv", "adakv"])
def test_a_prompt_said_complete_takes_a_call_of_several_tokens_and_a_chunk_is_still_refused(policy: str) -> None:
    # inside plan_from_prompt(model, width) a first call of the whole width holds the whole prompt: a question after
    # it may come in one call, equal to feeding it one token per call; a first call shorter than the width is a
    # chunk, and a call of several tokens after it is refused as before
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=50)
    model = t.LlamaForCausalLM(config).eval()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}),
                                                   kv=(policy, {"budget": 2, "observe": 2, "pool": 3})))
    ids = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(0))

    def prefill(width: int) -> object:
        with condcomp.plan_from_prompt(model, width):
            return model(input_ids=ids[:, :9], use_cache=True).past_key_values

    with torch.no_grad():
        got = model(input_ids=ids[:, 9:], past_key_values=prefill(9), use_cache=True).logits  # (2, 3, V)
        cache = prefill(9)
        want = torch.cat([model(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits
                          for i in range(9, 12)], 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="prefilled in one call"):
            model(input_ids=ids[:, 9:], past_key_values=prefill(12), use_cache=True)
        # the refusal says what to change inside the block too: a width wider than the prefill is read as a chunk
        with pytest.raises(ValueError, match=r"width at most the prefill's own"):
            model(input_ids=ids[:, 9:], past_key_values=prefill(10), use_cache=True)
