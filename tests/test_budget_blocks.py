"""``condcomp.budget`` blocks opened and closed out of order in one thread (generators, asyncio tasks).

Oracle: the model's output outside any block equals a deep copy's that never entered one, and inside a block it
equals that copy's under a single block of the same fraction. Out-of-order exits are refused with the fix named,
and the model is left as its own entries found it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import condcomp
from condcomp.api import routing_hosts

CFG = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk", executor="gathered")


def routed_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(condcomp.HeadAttention(32, 8), condcomp.HeadAttention(32, 8))
    condcomp.apply_(model, CFG)
    return model.eval()


def kept_heads(model: nn.Module, x: torch.Tensor) -> list[float]:
    with torch.no_grad():
        model(x)
    return [u.k_frac * 8 for u in condcomp.head_usage(model).values()]


def at_budget(fraction: float) -> Iterator[None]:
    """A generator that holds a budget block open across its yields, as a streaming server's handler might."""
    with condcomp.budget(MODEL, fraction):
        yield
        yield


MODEL = routed_model()


def test_out_of_order_exit_is_refused_and_the_model_returns_to_its_own_setting() -> None:
    x = torch.randn(2, 5, 32)
    untouched = copy.deepcopy(MODEL)
    assert kept_heads(MODEL, x) == kept_heads(untouched, x) == [4.0, 4.0]
    a, b = at_budget(0.25), at_budget(0.75)
    next(a)
    assert kept_heads(MODEL, x) == [2.0, 2.0]
    next(b)
    assert kept_heads(MODEL, x) == [6.0, 6.0]
    with pytest.raises(RuntimeError, match="reverse order") as err:
        a.close()  # A ends while B, opened inside it, is still open
    assert "copy.deepcopy" in str(err.value)
    assert kept_heads(MODEL, x) == [6.0, 6.0]  # B still holds its budget
    b.close()
    assert kept_heads(MODEL, x) == [4.0, 4.0]  # both closed: the model's own budget, as a fresh copy has
    with torch.no_grad():
        torch.testing.assert_close(MODEL(x), untouched(x), atol=0, rtol=0)
    for host in routing_hosts(MODEL).values():
        assert host.budget_fraction is None


def test_in_order_nesting_restores_each_level() -> None:
    x = torch.randn(2, 5, 32)
    with condcomp.budget(MODEL, 0.25):
        with condcomp.budget(MODEL, 0.75):
            assert kept_heads(MODEL, x) == [6.0, 6.0]
        assert kept_heads(MODEL, x) == [2.0, 2.0]
        with condcomp.disabled(MODEL), condcomp.budget(MODEL, 1.0):
            pass
        assert kept_heads(MODEL, x) == [2.0, 2.0]
    assert kept_heads(MODEL, x) == [4.0, 4.0]


def test_an_out_of_order_exit_of_another_kind_keeps_the_inner_setting() -> None:
    """A budget block closed while a disabled block it holds is open: the disabled block keeps its setting and its
    own exit restores what it found (routing on)."""
    x = torch.randn(2, 5, 32)
    ref = copy.deepcopy(MODEL)
    outer = condcomp.budget(MODEL, 0.25)
    inner = condcomp.disabled(MODEL)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    with torch.no_grad(), condcomp.disabled(ref):
        torch.testing.assert_close(MODEL(x), ref(x), atol=0, rtol=0)  # still disabled
    inner.__exit__(None, None, None)
    assert kept_heads(MODEL, x) == [4.0, 4.0]
    for host in routing_hosts(MODEL).values():
        assert host.budget_fraction is None and host.condcomp_disabled is False
