"""The ``adakv`` KV policy on the ``kv_cache`` executor against its rule written from scratch in float64: per row,
the layer's budget (``budget`` x the groups the policy holds) shared over those groups, each first guaranteed its
``floor`` share of its own best scores, the rest by score over all of them (SnapKV's scores: the last ``observe``
prompt queries' attention summed over the group's heads, average-pooled over ``pool`` tokens), plus the last
``window`` prompt tokens; the attention over the kept set at every later step. MHA and GQA, left padding, rows with
different plans (so different held-group counts and spare slots), prefill then decode, and the bytes by hand."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.kv import AdaKV, select_kv
from condcomp.types import AttentionInputs, AttentionWeights

sys_path = __import__("sys").path
sys_path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
import snapkv_rule  # noqa: E402
from core_helpers import make_layout, make_weights, random_active  # noqa: E402
from list_cache import prefill_then_steps  # noqa: E402

B, P, STEPS, D, H, Dh = 3, 14, 3, 16, 4, 4


def padding() -> Tensor:
    mask = torch.ones(B, P + STEPS, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[2, :8] = False  # 6 real prompt tokens
    return mask


def pooled_scores(policy: AdaKV, w: AttentionWeights, x: Tensor, real: list[int], g: int) -> dict[int, float]:
    """SnapKV's pooled score of each scored prompt token (before the recent window) of one row's group ``g``."""
    return snapkv_rule.pooled_scores(w, x, real, g, policy.observe, real[:len(real) - policy.recent], policy.pool)


def kept_by_rule(policy: AdaKV, w: AttentionWeights, x: Tensor, mask: Tensor, b: int,
                 groups: list[int]) -> dict[int, set[int]]:
    """Per held group of row ``b``, the sequence indices of the prompt tokens it keeps, from scratch."""
    real = [i for i in range(P) if mask[b, i]]
    recent = set(real[len(real) - policy.recent:])
    per_group = policy.budget if policy.fraction is None else max(0, int(len(real) * policy.fraction) - len(recent))
    assert per_group is not None
    scores = {g: pooled_scores(policy, w, x[b], real, g) for g in groups}
    kept = {g: set(sorted(s, key=lambda j: -s[j])[:int(per_group * policy.floor)]) for g, s in scores.items()}
    left = per_group * len(groups) - sum(len(k) for k in kept.values())
    rest = sorted(((s[j], g, j) for g, s in scores.items() for j in s if j not in kept[g]), reverse=True)
    for _, g, j in rest[:left]:
        kept[g].add(j)
    return {g: kept[g] | recent for g in groups}


def rule_bias(kept: list[dict[int, set[int]]], mask: Tensor, r: int) -> Tensor:
    """``(B, H, S, S)`` float64: causal over real tokens; a held group's heads after the prompt also only over its
    kept prompt tokens."""
    S = mask.shape[1]
    bias = torch.full((B, H, S, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                for j in range(i + 1):
                    if not (mask[b, i] and mask[b, j]):
                        continue
                    if h // r in kept[b] and i >= P and j < P and j not in kept[b][h // r]:
                        continue
                    bias[b, h, i, j] = 0.0
    return bias


@pytest.mark.parametrize("policy", [AdaKV(budget=3, observe=2, pool=3, floor=0.34),
                                    AdaKV(observe=3, pool=1, window=2, floor=0.0, fraction=0.5)])
@pytest.mark.parametrize(("Hkv", "ks"), [(4, [0, 2, 3]), (2, [2, 0, 1])])
def test_adakv_prefill_and_decode_equal_the_rule_from_scratch(policy: AdaKV, Hkv: int, ks: list[int]) -> None:
    torch.manual_seed(Hkv * 10 + sum(ks))
    layout = make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    w = AttentionWeights(layout, w.q_weight, w.k_weight, w.v_weight, w.o_weight)  # no biases: the rule's q.k
    x = torch.randn(B, P + STEPS, D, dtype=torch.float64) * 2
    mask = padding()
    active = random_active((B, H), torch.tensor(ks))
    plan = condcomp.plan_from_active(active)
    sel = select_kv(plan, layout, policy)
    y, cache = prefill_then_steps(w, x, mask, plan, sel, P)
    with torch.no_grad():
        held = ~active.view(B, Hkv, -1).any(-1)  # (B, Hkv): the groups the plan does not keep
        kept = [kept_by_rule(policy, w, x, mask, b, held[b].nonzero().flatten().tolist()) for b in range(B)]
        heads = active | held.repeat_interleave(H // Hkv, 1)
        bias = rule_bias(kept, mask, H // Hkv)
        ref = get_executor("reference")(w, AttentionInputs(x=x, mask=mask, attn_bias=bias),
                                        condcomp.plan_from_active(heads))
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-9)
    # the state: per (row, held group) exactly the rule's tokens, padded to the largest count; bytes by hand
    state = cache.windows
    assert state is not None and sel.window_index is not None
    counts = [len(k) for row in kept for k in row.values()]
    n = max(counts) + STEPS
    gw = int(held.sum(-1).max())
    assert tuple(state.keys.shape) == (B, gw, n, Dh)
    for b in range(B):
        for slot, g in enumerate(sel.window_index[b].tolist()[:int(held[b].sum())]):
            real = mask[b].long().cumsum(0) - 1  # sequence index -> position
            want = sorted(int(real[j]) for j in kept[b][g]) + [int(real[P + i]) for i in range(STEPS)]
            got = [p for p in state.positions[b, slot].tolist() if p >= 0]
            assert got == want, (b, g)
    assert sum(t.numel() * t.element_size() for t in policy.tensors(state)) == (
        2 * B * gw * n * Dh * 8 + B * gw * n * 8 + 2 * B * 8)


def test_adakv_shares_the_layer_budget_unevenly_and_skips_spare_slots() -> None:
    # one row, two held groups: group 0's scores are peaked on one token, group 1's spread; the floor guarantees
    # each group one token, the other four go by score over both
    policy = AdaKV(budget=3, observe=1, pool=1, floor=0.34)
    scores = torch.tensor([[[0.9, 0.01, 0.02, 0.03, -1.0], [0.2, 0.21, 0.22, 0.23, -1.0]]])  # (1, 2, 5)
    chosen = policy._choose(scores, torch.tensor([3]), torch.tensor([[True, True]]))
    assert chosen.sum(-1).tolist() == [[2, 4]] and chosen[0, 0, 0] and not chosen[0, :, 4].any()
    spare = policy._choose(scores, torch.tensor([3]), torch.tensor([[True, False]]))  # slot 1 repeats slot 0
    assert spare.sum(-1).tolist() == [[3, 0]]


def test_adakv_options_and_registration() -> None:
    assert "adakv" in condcomp.list_kv_policies()
    cfg = condcomp.CondCompConfig(kv=("adakv", {"fraction": 0.25, "observe": 8}))
    assert cfg.kv[0] == "adakv"
    with pytest.raises(ValueError, match=r"adakv kv policy: floor .* must be a finite number >= 0 and <= 1"):
        AdaKV(floor=1.5)
    with pytest.raises(ValueError, match="budget .* or fraction .*, not both"):
        AdaKV(budget=4, fraction=0.5)
    with pytest.raises(ValueError, match=r"fraction .* must be a finite number > 0 and <= 1"):
        AdaKV(fraction=0.0)
    with pytest.raises(ValueError, match=r"adakv kv policy: window .* must be a whole number >= 0"):
        AdaKV(window=-1)
    assert AdaKV().reads_slot_validity and condcomp.kv.SnapKV().reads_slot_validity  # spare slots: nothing


def test_adakv_state_follows_the_cache_operations_of_a_llama_cache() -> None:
    # reorder (beams), row selection, copy, pickle and crop act on the adakv state with the cache: continuing each
    # equals continuing the original cache on the same rows
    import copy
    import pickle

    t = pytest.importorskip("transformers")
    sys_path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "integrations" / "hf"))
    from decode_helpers import extend, llama, prompts, step

    model = llama(4)
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                   router=("topk", {"kv_groups": True}),
                                                   kv=("adakv", {"budget": 2, "observe": 2, "pool": 3})))
    model.eval()
    ids, mask = prompts()
    cache = t.DynamicCache()
    tokens, mask = extend(ids, mask, step(model, ids, mask, cache, ids.shape[1]).argmax(-1, keepdim=True))
    before = copy.deepcopy(cache)
    want = step(model, tokens, mask, cache, 1)  # (B, V)
    order = torch.tensor([2, 0, 1])
    beams = copy.deepcopy(before)
    beams.reorder_cache(order)
    torch.testing.assert_close(step(model, tokens[order], mask[order], beams, 1), want[order])
    picked = pickle.loads(pickle.dumps(before))
    picked.batch_select_indices(torch.tensor([0, 2]))
    torch.testing.assert_close(step(model, tokens[[0, 2]], mask[[0, 2]], picked, 1), want[[0, 2]])
    cache.crop(-1)  # back to the cache before the step
    torch.testing.assert_close(step(model, tokens, mask, cache, 1), want)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-3)  # into the compressed prompt
