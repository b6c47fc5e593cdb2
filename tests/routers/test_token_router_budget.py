"""``condcomp.budget(model, f)`` on the token routers (moh, norm): the heads each token gets, counted by hand.

Oracle: the budget rule written out here (k = floor(f * H), at least 1), independent of the routers' code. A fraction
whose k is below the shared heads (always on) cannot be given: it is refused, naming the fraction h_s / H the layer
would give (it used to give h_s heads without a word). 1.0 means every head, and the count never falls as f grows.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import condcomp

FRACTIONS = [0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]


def hand_count(fraction: float, num_heads: int) -> int:
    return max(1, math.floor(fraction * num_heads + 1e-9))  # the fixed budget's rule: floor, k_min = 1


ROUTERS = [("moh", {"shared_heads": 4, "top_k": 2}), ("norm", {"shared_heads": 2, "top_k": 3}),
           ("moh", {"shared_heads": 0, "top_k": 3}), ("norm", {"shared_heads": 8, "top_k": 0})]


@pytest.mark.parametrize("router", ROUTERS)
def test_budget_on_token_routers_counts_heads_by_hand(router: tuple[str, dict[str, int]]) -> None:
    torch.manual_seed(0)
    H, shared = 8, router[1]["shared_heads"]
    model = nn.Sequential(condcomp.HeadAttention(32, H))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router=router))
    model.eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        model(x)
        # outside a block: the router's own count (shared + top_k) at the full policy, as before
        own = condcomp.head_usage(model)["0"].k_frac * H
        assert own == pytest.approx(shared + router[1]["top_k"])
        counts, given = [], [f for f in FRACTIONS if hand_count(f, H) >= shared]
        for f in FRACTIONS:
            if f not in given:
                with pytest.raises(ValueError, match=rf"fraction {f} asks {hand_count(f, H)} of the 8 heads of layer "
                                                     rf"'0', but its {router[0]} router always computes {shared} heads "
                                                     rf".* would be {shared / H:g}, not {f}"):
                    condcomp.budget(model, f).__enter__()
                continue
            with condcomp.budget(model, f):
                model(x)
            counts.append(condcomp.head_usage(model)["0"].k_frac * H)
    assert counts == pytest.approx([hand_count(f, H) for f in given])
    assert counts[-1] == H  # 1.0: every head
    assert all(a <= b for a, b in zip(counts, counts[1:]))  # monotone in f
