"""The ``headkv`` KV policy (each KV group its own share of the prompt) on the ``kv_cache`` executor against its rule
written from scratch in float64: per (row, group) the first ``sinks`` tokens, the last ``window``, and the rest by
SnapKV's pooled score, ``floor(share * prompt)`` in all; the attention over them at every later step; its bytes
counted by hand; ``check_kv_policy``; the options it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.kv import HeadKV, SnapKV, select_kv
from condcomp.types import AttentionInputs, AttentionWeights

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import snapkv_rule  # noqa: E402
from core_helpers import make_layout, make_weights, random_active  # noqa: E402
from list_cache import prefill_then_steps  # noqa: E402

B, P, STEPS, D, H, Dh = 3, 14, 3, 16, 4, 4


def padding() -> Tensor:
    mask = torch.ones(B, P + STEPS, dtype=torch.bool)
    mask[1, :2] = False  # left padding: 12 real prompt tokens
    mask[2, :7] = False  # 7 real prompt tokens
    return mask


def kept_by_rule(policy: HeadKV, w: AttentionWeights, x: Tensor, mask: Tensor, b: int, g: int) -> set[int]:
    """The sequence indices of the prompt tokens row ``b``'s group ``g`` keeps, from scratch in float64."""
    real = [i for i in range(P) if mask[b, i]]
    n = int(len(real) * policy.shares[g] + 1e-9)  # floor(share * prompt), exact for these shares
    sinks = real[:min(policy.sinks, n)]
    tail_n = n - len(sinks) if policy.select == "window" else min(policy.recent, n - len(sinks))
    tail = real[len(real) - tail_n:] if tail_n else []
    rest = [j for j in real if j not in sinks and j not in tail]
    picks = n - len(sinks) - len(tail)
    if picks <= 0:
        return set(sinks) | set(tail)
    pooled = snapkv_rule.pooled_scores(w, x[b], real, g, policy.observe, rest, policy.pool)
    best = sorted(rest, key=lambda j: -pooled[j])[:picks]
    return set(sinks) | set(tail) | set(best)


def rule_bias(policy: HeadKV, w: AttentionWeights, x: Tensor, mask: Tensor, held: Tensor) -> Tensor:
    """``(B, H, S, S)`` float64: causal over real tokens; a held group's heads after the prompt read only its kept
    prompt tokens (and every later token)."""
    return snapkv_rule.kept_prompt_bias(mask, held, lambda b, g: kept_by_rule(policy, w, x, mask, b, g), P, H,
                                        w.layout.group_size)


POLICIES = [HeadKV(shares=(0.5, 0.25, 1.0, 0.75), sinks=1, observe=2, pool=3),
            HeadKV(shares=(0.5, 0.25, 1.0, 0.75), sinks=2, observe=3, pool=1, window=1),
            HeadKV(shares=(0.5, 0.25, 1.0, 0.75), sinks=1, observe=2, pool=3, select="window")]


@pytest.mark.parametrize("policy", POLICIES, ids=["snapkv", "window1", "select-window"])
@pytest.mark.parametrize("ks", [[0, 2, 1], [1, 3, 2]])
def test_headkv_prefill_and_decode_equal_the_rule_from_scratch(policy: HeadKV, ks: list[int]) -> None:
    torch.manual_seed(sum(ks) + len(policy.select))
    layout = make_layout(H=H, Hkv=H, Dh=Dh, D=D, causal=True)  # MHA: 4 groups, one share each
    w = make_weights(layout, torch.float64)
    w = AttentionWeights(layout, w.q_weight, w.k_weight, w.v_weight, w.o_weight)  # no biases: the rule's q.k
    x = torch.randn(B, P + STEPS, D, dtype=torch.float64)
    mask = padding()
    active = random_active((B, H), torch.tensor(ks))
    plan = condcomp.plan_from_active(active)
    y, cache = prefill_then_steps(w, x, mask, plan, select_kv(plan, layout, policy), P)
    held = ~active  # (B, Hkv): the groups the plan does not keep, held by the policy
    with torch.no_grad():
        ref = get_executor("reference")(w, AttentionInputs(x=x, mask=mask, attn_bias=rule_bias(policy, w, x, mask,
                                                                                                   held)),
                                        condcomp.plan_from_active(torch.ones_like(active)))
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-9)
    # bytes by hand: the state is padded to the largest count of a held (row, group), plus one entry per step
    counts = [int(int(mask[b, :P].sum()) * policy.shares[g] + 1e-9) for b in range(B) for g in range(H) if held[b, g]]
    N, gw = max(counts) + STEPS, int(held.sum(-1).max())
    state = cache.windows
    assert state is not None and tuple(state.keys.shape) == (B, gw, N, Dh)
    assert sum(t.numel() * t.element_size() for t in policy.tensors(state)) == (
        2 * B * gw * N * Dh * 8 + B * gw * N * 8 + 2 * B * 8)  # keys, values (float64), positions, seen, prompt


def test_equal_shares_without_sinks_keep_what_snapkv_keeps_at_that_fraction() -> None:
    torch.manual_seed(3)
    layout = make_layout(H=H, Hkv=2, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    x = torch.randn(B, P + STEPS, D, dtype=torch.float64)
    mask = padding()
    active = torch.zeros(B, H, dtype=torch.bool)  # every group held by the policy
    plan = condcomp.plan_from_active(active)
    outs = [prefill_then_steps(w, x, mask, plan, select_kv(plan, layout, policy), P)[0]
            for policy in (HeadKV(shares=(0.5, 0.5), sinks=0, observe=2, pool=3),
                           SnapKV(fraction=0.5, observe=2, pool=3))]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=0)


@pytest.mark.slow
def test_headkv_passes_check_kv_policy() -> None:
    pytest.importorskip("transformers")
    from condcomp.testing import check_kv_policy

    check_kv_policy("headkv", {"shares": (0.5, 0.34, 1.0, 0.25), "sinks": 1, "observe": 1, "pool": 1})
    check_kv_policy("headkv", {"shares": (0.5, 0.34, 1.0, 0.25), "sinks": 1, "observe": 2, "pool": 3,
                               "select": "window"})


@pytest.mark.parametrize("options, match", [
    ({"shares": (0.5, float("nan"))}, r"share 1 is nan, outside \(0, 1\]"),
    ({"shares": (0.0, 0.5)}, r"share 0 is 0.0, outside \(0, 1\]"),
    ({"shares": (0.5, 1.5)}, r"share 1 is 1.5"),
    ({"shares": ("a",)}, "not a number"),
    ({"shares": (0.5,), "fraction": 0.25}, "not both"),
    ({"select": "random"}, "select must be one of snapkv, window"),
    ({"sinks": -1}, "sinks"),
])
def test_headkv_refuses_bad_options_by_name(options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HeadKV(**options)  # type: ignore[arg-type]


def test_shares_must_cover_every_group_the_layer_holds() -> None:
    layout = make_layout(H=H, Hkv=H, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    x = torch.randn(1, 6, D, dtype=torch.float64)
    plan = condcomp.plan_from_active(torch.tensor([[True, False, True, False]]))
    with pytest.raises(ValueError, match=r"shares gives 2 KV group\(s\), and this layer holds group 3"):
        prefill_then_steps(w, x, torch.ones(1, 6, dtype=torch.bool), plan,
                           select_kv(plan, layout, HeadKV(shares=(0.5, 0.5))), 6)
    assert "headkv" in condcomp.list_kv_policies() and HeadKV().reads_slot_groups
