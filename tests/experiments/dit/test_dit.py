"""The DiT experiment's parts: the sampler, the Fréchet distance (against float64 hand computations), the
conditioned budget policy and the way a condition reaches it, and the model's input checks."""

from __future__ import annotations

import math

import pytest
import torch
from condcomp.policies.budgetformer_cond import ConditionedBudgetPolicy
from torch import nn

import condcomp
from condcomp.api import routed_modules
from condcomp.experiments.dit.flow import flow_matching_loss, sample
from condcomp.experiments.dit.frechet import frechet_distance, frechet_from_stats
from condcomp.experiments.dit.model import DiT, DiTConfig
from condcomp.experiments.dit.variants import variant_config

TINY = DiTConfig(image_size=8, patch=2, d_model=40, num_layers=2, num_heads=20, freq_dim=16)


def tiny_dit(variant: str = "dense", seed: int = 0) -> DiT:
    torch.manual_seed(seed)
    model = DiT(TINY)
    config = variant_config(variant, TINY.num_heads, TINY.num_layers, TINY.d_model, "auto", 0.5)
    if config is not None:
        condcomp.apply_(model, config)
    return model


# ------------------------------------------------------------------------------------------------ sampler
@pytest.mark.parametrize("variant", ["dense", "moh_75", "budgetformer_cond"])
@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_sampler_shapes_and_determinism_under_a_seed(variant: str, guidance: float) -> None:
    model = tiny_dit(variant).eval()
    with torch.no_grad():
        for p in model.parameters():  # away from adaLN-Zero's identity start, so the model's output matters
            p.add_(0.05 * torch.randn_like(p))
    labels = torch.tensor([0, 1, 2, 9])
    steps: list[float] = []
    a = sample(model, labels, steps=3, guidance=guidance, seed=7, on_step=lambda i, t: steps.append(t))
    b = sample(model, labels, steps=3, guidance=guidance, seed=7)
    c = sample(model, labels, steps=3, guidance=guidance, seed=8)
    assert a.shape == (4, 1, 8, 8)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert steps == pytest.approx([1.0, 2 / 3, 1 / 3])  # noise levels of the Euler steps, from pure noise


def test_sampler_with_a_zero_velocity_returns_the_initial_noise() -> None:
    # The final layer starts at zero (adaLN-Zero): v = 0, so the ODE leaves x_1 ~ N(0, I) unchanged.
    model = tiny_dit().eval()
    out = sample(model, torch.tensor([3, 4]), steps=4, guidance=3.0, seed=11)
    want = torch.randn((2, 1, 8, 8), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(out, want)


def test_sampler_and_model_refuse_bad_inputs() -> None:
    model = tiny_dit().eval()
    with pytest.raises(ValueError, match="labels must be"):
        sample(model, torch.tensor([10]), steps=2)
    with pytest.raises(ValueError, match="steps must be"):
        sample(model, torch.tensor([1]), steps=0)
    with pytest.raises(ValueError, match="images must be"):
        model(torch.randn(2, 1, 6, 6), torch.rand(2), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="labels must lie"):
        model(torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 11]))


def test_flow_matching_loss_is_the_velocity_error() -> None:
    # A model that predicts exactly eps - x0 (it is told them) has zero loss; one that predicts 0 has E|eps-x0|^2.
    x0 = torch.randn(6, 1, 8, 8)

    class Oracle(nn.Module):
        config = TINY

        def forward(self, xt: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            tt = t.view(-1, 1, 1, 1)
            eps = (xt - (1 - tt) * x0) / tt
            return eps - x0

    loss, t = flow_matching_loss(Oracle(), x0, torch.zeros(6, dtype=torch.long), torch.Generator().manual_seed(0))
    assert float(loss) < 1e-8 and t.shape == (6,)


# ------------------------------------------------------------------------------------------------ Fréchet
def test_frechet_distance_of_diagonal_gaussians_is_the_closed_form() -> None:
    # Commuting (diagonal) covariances: FD = |mu_a - mu_b|^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2.
    mu_a, mu_b = torch.tensor([0.0, 1.0, -2.0]), torch.tensor([1.0, 1.0, 0.5])
    va, vb = [1.0, 4.0, 0.25], [2.0, 1.0, 0.25]
    want = sum((x - y) ** 2 for x, y in zip(mu_a.tolist(), mu_b.tolist()))
    want += sum((math.sqrt(x) - math.sqrt(y)) ** 2 for x, y in zip(va, vb))
    got = frechet_from_stats(mu_a, torch.diag(torch.tensor(va)), mu_b, torch.diag(torch.tensor(vb)))
    assert got == pytest.approx(want, rel=1e-10)


def test_frechet_distance_of_correlated_gaussians_matches_scipy_sqrtm() -> None:
    np = pytest.importorskip("numpy")
    linalg = pytest.importorskip("scipy.linalg", reason="scipy comes with scikit-learn (extra 'vision')")
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    ca, cb = A @ A.T + 0.1 * np.eye(4), B @ B.T + 0.1 * np.eye(4)
    ma, mb = rng.normal(size=4), rng.normal(size=4)
    want = float(((ma - mb) ** 2).sum() + np.trace(ca) + np.trace(cb) - 2 * np.trace(linalg.sqrtm(ca @ cb).real))
    got = frechet_from_stats(*(torch.tensor(v) for v in (ma, ca, mb, cb)))
    assert got == pytest.approx(want, rel=1e-8)


def test_frechet_distance_of_samples_uses_their_mean_and_unbiased_covariance() -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn((50, 3), generator=g), 2.0 + 0.5 * torch.randn((40, 3), generator=g)
    mu_a, mu_b = a.double().mean(0), b.double().mean(0)
    ca = (a.double() - mu_a).T @ (a.double() - mu_a) / 49
    cb = (b.double() - mu_b).T @ (b.double() - mu_b) / 39
    assert frechet_distance(a, b) == pytest.approx(frechet_from_stats(mu_a, ca, mu_b, cb), rel=1e-10)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="NaN"):
        frechet_distance(a, torch.full((5, 3), float("nan")))
    with pytest.raises(ValueError, match="N >= 2"):
        frechet_distance(a[:1], b)


# ------------------------------------------------------------------------------------------------ conditioned policy
def test_the_conditioned_policy_gets_gradients_through_the_dit() -> None:
    model = tiny_dit("budgetformer_cond").train()
    with torch.no_grad():  # adaLN-Zero's zero gates and output layer would block every gradient at the start
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, t, y = torch.randn(4, 1, 8, 8), torch.tensor([0.05, 0.3, 0.7, 0.95]), torch.tensor([1, 2, 3, 10])
    loss = model(x, t, y).pow(2).mean() + condcomp.aux_loss(model)
    loss.backward()
    for name, r in routed_modules(model).items():
        policy = r.condcomp_policy
        assert isinstance(policy, ConditionedBudgetPolicy)
        grad = policy.mlp.fc1.weight.grad
        assert grad is not None, name
        assert grad[:, TINY.d_model:].abs().sum() > 0, f"{name}: no gradient reaches the condition's weights"
        assert policy.mlp.fc2.weight.grad.abs().sum() > 0
    # The condition is the timestep embedding: the policy's budget moves with t alone.
    policy = routed_modules(model)["blocks.0.attn"].condcomp_policy
    xs = torch.zeros(2, 16, TINY.d_model)
    c = model.condition(torch.tensor([0.0, 1.0]), torch.tensor([1, 1]))
    s = policy(xs, None, condition=c).s
    assert float((s[0] - s[1]).abs().detach()) > 0


def test_a_condition_reaches_only_policies_that_read_it() -> None:
    layer = condcomp.HeadAttention(16, 4)
    x = torch.randn(2, 3, 16)
    routed = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(
        policy=("budgetformer_cond", {"condition_dim": 5}), router="topk"))
    seen = []
    routed.condcomp_policy.register_forward_hook(lambda m, a, kw, out: seen.append(kw["condition"]), with_kwargs=True)
    c = torch.randn(2, 5)
    routed(x, condition=c)
    assert seen and seen[0] is c
    with pytest.raises(ValueError, match="no condition was passed"):
        routed(x)
    with pytest.raises(ValueError, match=r"condition must be \(B, Dc\)"):
        routed(x, condition=torch.randn(2, 4))
    # A policy that does not read it keeps the two-argument protocol call; dense attention ignores it.
    fixed = condcomp.RoutedAttention.wrap(condcomp.HeadAttention(16, 4), condcomp.CondCompConfig(
        policy=("fixed", {"fraction": 0.5}), router="topk"))
    assert fixed(x, condition=c).shape == (2, 3, 16)
    torch.testing.assert_close(layer(x, condition=c), layer(x))
    with pytest.raises(ValueError, match="condition_dim"):
        ConditionedBudgetPolicy(d_model=8, num_heads=4, condition_dim=0)
