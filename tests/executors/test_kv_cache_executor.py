"""The kv_cache executor on a compact cache (prefill, then decode steps) against the per-head reference loop.

The reference computes the whole sequence at once, without a cache, every key/value head projected: the per-head
loop with the plan's gates and, for streamed groups, an additive bias written out here entry by entry from the
rule (a query at real-token position p sees key j when j <= p and (j < sinks or p - j < window)). The cached path
projects, stores and reads only what the plan keeps, one call per step.
"""

from __future__ import annotations

import pytest
import torch
from core_helpers import make_layout, make_weights, random_active, rotary_tables
from list_cache import ListCache, prefill_then_steps
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.executors.cached import CompactKV
from condcomp.kv.selection import KV_FULL, KV_NONE, KV_WINDOW, StreamWindow, select_kv
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

B, P, STEPS, D, H, Dh = 4, 6, 5, 16, 4, 4


def padding() -> Tensor:
    mask = torch.ones(B, P + STEPS, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    mask[2, :5] = False
    return mask


def reference_bias(mask: Tensor, modes: Tensor, r: int, window: StreamWindow | None) -> Tensor:
    """``(B, H, S, S)`` additive bias: causal over real keys; a streamed group's heads also by the window rule."""
    S = mask.shape[1]
    pos = (mask.long().cumsum(-1) - 1).tolist()
    bias = torch.full((B, H, S, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            streamed = int(modes[b, h // r]) == KV_WINDOW
            for i in range(S):
                for j in range(i + 1):
                    if not (mask[b, i] and mask[b, j]):
                        continue
                    p, q = pos[b][i], pos[b][j]
                    if streamed and window is not None and not (q < window.sinks or p - q < window.window):
                        continue
                    bias[b, h, i, j] = 0.0
    return bias


def cached_run(w: AttentionWeights, x: Tensor, mask: Tensor, plan: HeadPlan, rotary: tuple[Tensor, Tensor],
               window: StreamWindow | None) -> tuple[Tensor, ListCache]:
    """Prefill the prompt, then one call per token; outputs ``(B, S, D)`` and the cache."""
    return prefill_then_steps(w, x[:, :P + STEPS], mask[:, :P + STEPS], plan, select_kv(plan, w.layout, window), P,
                              rotary)


@pytest.mark.parametrize("Hkv", [4, 2, 1])
@pytest.mark.parametrize("ks", [[0, 1, 4, 2], [4, 4, 4, 4], [0, 0, 0, 0], [2, 3, 1, 4]])
@pytest.mark.parametrize("window", [None, StreamWindow(sinks=1, window=3), StreamWindow(sinks=0, window=2)])
def test_cached_calls_equal_the_reference_on_the_whole_sequence(Hkv: int, ks: list[int],
                                                               window: StreamWindow | None) -> None:
    torch.manual_seed(len(ks) * 7 + Hkv)
    layout = make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    r = layout.group_size
    S = P + STEPS
    x = torch.randn(B, S, D, dtype=torch.float64)
    mask = padding()
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    rotary = rotary_tables(B, S + 8, Dh, torch.float64)
    rotary = tuple(t.gather(1, pos[:, :, None].expand(B, S, Dh)) for t in rotary)  # at real-token positions
    active = random_active((B, H), torch.tensor(ks))
    gates = torch.rand(B, H, dtype=torch.float64) + 0.5
    plan = condcomp.plan_from_active(active, gates)
    with torch.no_grad():
        y, cache = cached_run(w, x, mask, plan, rotary, window)
        kept = active.view(B, Hkv, r).any(-1)
        modes = torch.where(kept, KV_FULL, KV_WINDOW if window is not None else KV_NONE)
        streamed = (modes == KV_WINDOW).repeat_interleave(r, 1)  # (B, H)
        ref_plan = condcomp.plan_from_active(active | streamed, torch.where(streamed, torch.ones_like(gates), gates))
        inputs = AttentionInputs(x=x, mask=mask, attn_bias=reference_bias(mask, modes, r, window), rotary=rotary)
        y_ref = get_executor("reference")(w, inputs, ref_plan)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-9)
    # the cache holds exactly what the plan keeps: the most full groups of any row, and each streamed group's window
    g_full = int(kept.sum(-1).max())
    assert cache.k is not None
    if g_full or window is None:
        assert cache.k.shape == (B, max(g_full, 1), S, Dh)
    else:
        assert cache.k.shape == (B, 1, S, 1)  # a placeholder that counts the tokens
    if window is not None and bool((~kept).any()):
        assert cache.windows is not None
        assert cache.windows.keys.shape == (B, int((~kept).sum(-1).max()), min(S, window.capacity), Dh)
    else:
        assert cache.windows is None


def test_a_token_plan_is_refused_on_a_compact_cache_with_the_reason() -> None:
    layout = make_layout(H=H, Hkv=2, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    x = torch.randn(2, 3, D, dtype=torch.float64)
    plan = condcomp.plan_from_active(random_active((2, 3, H)))
    seq = condcomp.plan_from_active(torch.ones(2, H, dtype=torch.bool))
    compact = CompactKV(select_kv(seq, layout), ListCache().store)
    with pytest.raises(RuntimeError, match="per-token plan"):
        get_executor("kv_cache")(w, AttentionInputs(x=x), plan, cache=compact)


def test_explain_lists_the_kv_cache_executor_and_auto_prefers_dense_without_a_cache() -> None:
    layout = make_layout(H=H, Hkv=2, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    plan = condcomp.plan_from_active(random_active((2, H), torch.tensor([1, 2])))
    choice = condcomp.explain(w, AttentionInputs(x=torch.randn(2, 3, D, dtype=torch.float64)), plan)
    assert choice.executor != "kv_cache"
    assert any(name == "kv_cache" and "cost" in why for name, why in choice.verdicts)


def test_window_entries_are_taken_as_gather_takes_them() -> None:
    """The window trim's row copy (index_select over flattened entries) against torch.gather on the same index."""
    from condcomp.kv.window import take_entries

    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 2, 9, 4, generator=g)
    chosen = torch.stack([torch.randperm(9, generator=g)[:5] for _ in range(3)])  # (B, K), any order per row
    expected = t.gather(2, chosen[:, None, :, None].expand(3, 2, 5, 4))
    assert torch.equal(take_entries(t, chosen), expected)
    assert torch.equal(take_entries(t.transpose(2, 3).contiguous().transpose(2, 3), chosen), expected)  # strided
