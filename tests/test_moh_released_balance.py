"""MoH's load balance weighted as the released training scripts do (``balance="released"``), against an
independent float64 computation of ``0.01 * mean over routed layers of E * sum_i f_i P_i``."""

from __future__ import annotations

import math

import pytest
import torch
from condcomp.routers.moh import MoHRouter
from torch import nn

import condcomp


def released_balance_float64(inputs: list[torch.Tensor], w_r: list[torch.Tensor], top_k: int,
                             beta: float = 0.01) -> float:
    """``beta * mean_l E * sum_i f_i P_i`` with plain Python loops in float64 (no condcomp code)."""
    terms = []
    for x, w in zip(inputs, w_r):
        xs = x.double().reshape(-1, x.shape[-1]).tolist()
        W = w.double().tolist()
        E = len(W)
        f = [0.0] * E
        P = [0.0] * E
        for tok in xs:
            logits = [sum(a * b for a, b in zip(row, tok)) for row in W]
            m = max(logits)
            e = [math.exp(v - m) for v in logits]
            probs = [v / sum(e) for v in e]
            chosen = sorted(range(E), key=lambda i: -logits[i])[:top_k]
            for i in range(E):
                P[i] += probs[i] / len(xs)
                f[i] += (i in chosen) / len(xs)
        terms.append(E * sum(a * b for a, b in zip(f, P)))
    return beta * sum(terms) / len(terms)


def moh_stack(layers: int, balance: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(*[condcomp.HeadAttention(18, 6) for _ in range(layers)])
    router = ("moh", {"shared_heads": 2, "top_k": 2, **balance})
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router=router, executor="masked"))
    return model


@pytest.mark.parametrize("layers", [1, 3])
def test_released_balance_is_the_mean_over_layers_of_e_times_sum_f_p(layers: int) -> None:
    model = moh_stack(layers, {"balance": "released", "balance_layers": layers}).train()
    seen: list[torch.Tensor] = []
    routers = [r.condcomp_router for r in condcomp.api.routed_modules(model).values()]
    hooks = [r.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone())) for r in routers]
    model(torch.randn(3, 7, 18))
    for h in hooks:
        h.remove()
    want = released_balance_float64(seen, [r.w_r.weight.detach() for r in routers], top_k=2)
    got = float(condcomp.aux_loss(model).detach())
    assert got == pytest.approx(want, rel=1e-5)
    # E = 4 routed heads: the released value is E / layers times the per-layer default on the same routing.
    default = moh_stack(layers, {}).train()
    default.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    x = torch.randn(3, 7, 18)
    model(x)
    default(x)
    released, per_layer = float(condcomp.aux_loss(model).detach()), float(condcomp.aux_loss(default).detach())
    assert released == pytest.approx(per_layer * 4 / layers, rel=1e-6)


def test_released_balance_is_k_at_uniform_routing() -> None:
    # With all router weights zero every head has probability 1/E: E * sum f_i P_i = E * K / E = K per layer,
    # and the mean over layers is K, so the loss is 0.01 * K whatever the layer count.
    model = moh_stack(4, {"balance": "released", "balance_layers": 4})
    for r in condcomp.api.routed_modules(model).values():
        for p in r.condcomp_router.parameters():
            nn.init.zeros_(p)
    model(torch.randn(2, 5, 18))
    assert float(condcomp.aux_loss(model).detach()) == pytest.approx(0.01 * 2, rel=1e-6)


def test_released_balance_needs_the_layer_count() -> None:
    with pytest.raises(ValueError, match="balance_layers"):
        MoHRouter(d_model=8, num_heads=4, balance="released")
    with pytest.raises(ValueError, match="balance must be one of"):
        MoHRouter(d_model=8, num_heads=4, balance="mean")
    with pytest.raises(ValueError, match="only applies"):
        MoHRouter(d_model=8, num_heads=4, balance_layers=2)
