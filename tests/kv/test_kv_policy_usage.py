"""``head_usage`` at a decode step of a KV policy with a state of its own other than ``window``: its groups' heads
read what the state held plus the call's tokens (``snapkv``: ``budget + observe`` prompt entries and every later
token), not the whole context. Red team round 5: ``flop_frac`` counted them over every key, as ``kv="full"``'s
(1.00 where the reads are 0.61 of dense). Oracle: FLOPs counted by hand per head over the dense block's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import condcomp
from condcomp.kv import KV_FULL, KV_WINDOW

t = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "integrations" / "hf"))
from decode_helpers import llama  # noqa: E402
from flops_by_hand import flop_frac_by_hand  # noqa: E402

BUDGET, OBSERVE, P = 3, 2, 20


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_snapkv_groups_count_over_the_entries_they_read_at_a_decode_step(kv_heads: int) -> None:
    model = llama(kv_heads)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"kv_groups": True}),
                                  kv=("snapkv", {"budget": BUDGET, "observe": OBSERVE, "pool": 3}))
    condcomp.apply_(model, cfg)
    model.eval()
    ids = torch.randint(1, 97, (2, P), generator=torch.Generator().manual_seed(1))
    cache = t.DynamicCache()
    with torch.no_grad():
        first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        model(input_ids=first, past_key_values=cache, use_cache=True)
    T, S = 1, P + 1
    n = BUDGET + OBSERVE + T  # the kept prompt entries and the step's own token
    usage = condcomp.head_usage(model)
    for name, plan in condcomp.request_plans(model, cache).items():
        assert plan.kv_modes is not None
        full, held = (plan.kv_modes == KV_FULL).sum(-1), (plan.kv_modes == KV_WINDOW).sum(-1)
        assert bool(held.any())
        routed = condcomp.api.routed_modules(model)[name]
        want = flop_frac_by_hand(model.config, routed, full, held, T, S, n)
        assert usage[name].flop_frac == pytest.approx(want, rel=1e-9)
