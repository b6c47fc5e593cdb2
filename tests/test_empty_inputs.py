"""Empty inputs (no tokens, no examples, every token padding) in training: a zero auxiliary loss with its graph,
finite usage, and an optimizer step that leaves every weight as it was (nothing was seen, nothing is learned).

Reference: the weights before the step, and zero: an empty batch carries no signal.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import condcomp

OPTIONS = {"fixed": {"fraction": 0.5}, "moh": {"shared_heads": 1, "top_k": 2}, "norm": {"shared_heads": 1},
           "budgetformer": {"s_min": 0.8, "s_max": 0.9}}  # s starts at 0.6: the hinge would be active


def _spec(key: str) -> tuple[str, dict[str, object]]:
    return key, dict(OPTIONS.get(key, {}))


@pytest.mark.parametrize("shape,padding", [((2, 0), False), ((0, 5), False), ((2, 5), True)])
@pytest.mark.parametrize("executor", ["gathered", "masked", "reference"])
@pytest.mark.parametrize("policy,router", list(itertools.product(condcomp.list_policies(), condcomp.list_routers())))
def test_empty_inputs_train_nothing(policy: str, router: str, executor: str, shape: tuple[int, int],
                                    padding: bool) -> None:
    model = nn.Sequential(condcomp.HeadAttention(16, 4))
    condcomp.apply_(model, condcomp.CondCompConfig(policy=_spec(policy), router=_spec(router), executor=executor))
    condcomp.set_progress(model, 0.9)  # the entropy coefficient is nonzero at the end of training
    model.train()
    B, T = shape
    x = torch.randn(B, T, 16)
    mask = torch.zeros(B, T, dtype=torch.bool) if padding else None
    routing = {n: p for n, p in model.named_parameters() if "condcomp_" in n}
    before = {n: p.detach().clone() for n, p in routing.items()}
    y = model[0](x, mask, condition=torch.randn(B, 16))  # read only by policies that declare reads_condition
    assert y.shape == (B, T, 16) and torch.isfinite(y).all()
    aux = condcomp.aux_loss(model)
    assert float(aux.detach()) == 0.0
    if routing:
        assert aux.requires_grad
        opt = torch.optim.Adam(routing.values(), lr=0.1)
        (y.sum() + aux).backward()
        opt.step()
        for n, p in routing.items():
            assert torch.equal(p, before[n]), n
    usage = condcomp.head_usage(model)["0"]
    assert all(math.isfinite(v) for v in (usage.s_mean, usage.k_frac, usage.flop_frac))
