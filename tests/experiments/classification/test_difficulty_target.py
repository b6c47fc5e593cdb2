"""The difficulty target of ``--budget-target`` against scipy's ranks and a float64 loss written out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import condcomp
from condcomp.api import routed_modules
from condcomp.experiments.classification.difficulty_target import difficulty_target_loss, loss_rank_targets
from condcomp.experiments.classification.model import EncoderClassifier, ModelConfig
from condcomp.experiments.classification.runconfig import RunConfig
from condcomp.experiments.classification.train import _train_step, build_model, make_optimizer, make_scheduler

stats = pytest.importorskip("scipy.stats")


def _scipy_targets(loss: torch.Tensor, s_min: float, s_max: float) -> torch.Tensor:
    rank = torch.as_tensor(stats.rankdata(loss.double().numpy(), method="average"), dtype=torch.float64) - 1
    return s_min + (s_max - s_min) * rank / (loss.numel() - 1)


@pytest.mark.parametrize("loss", [torch.tensor([0.3, 2.0, 0.1, 0.7]),
                                  torch.tensor([1.0, 1.0, 0.5, 1.0, 3.0]),  # ties share their mean rank
                                  torch.rand(32)])
def test_targets_are_the_loss_ranks_mapped_onto_the_interval(loss: torch.Tensor) -> None:
    got = loss_rank_targets(loss, 0.1, 0.3)
    torch.testing.assert_close(got.double(), _scipy_targets(loss, 0.1, 0.3), rtol=0, atol=1e-6)


def test_one_example_gets_the_middle_and_bad_shapes_are_refused() -> None:
    assert loss_rank_targets(torch.tensor([4.0]), 0.1, 0.3).tolist() == pytest.approx([0.2])
    with pytest.raises(ValueError, match=r"\(B,\)"):
        loss_rank_targets(torch.ones(2, 3), 0.1, 0.3)


def test_loss_is_the_mean_squared_distance_to_the_targets_over_layers() -> None:
    loss = torch.tensor([0.2, 1.5, 0.9])
    s0, s1 = torch.tensor([0.5, 0.6, 0.7]), torch.tensor([0.1, 0.2, 0.3])
    got = difficulty_target_loss([(0.1, 0.9, s0), (0.0, 0.5, s1)], loss)
    t0 = torch.tensor([0.1, 0.9, 0.5], dtype=torch.float64)  # ranks 0, 2, 1
    t1 = torch.tensor([0.0, 0.5, 0.25], dtype=torch.float64)
    want = 0.5 * (((s0.double() - t0) ** 2).mean() + ((s1.double() - t1) ** 2).mean())
    assert float(got) == pytest.approx(float(want), abs=1e-7)


def test_what_cannot_be_targeted_is_refused() -> None:
    with pytest.raises(ValueError, match="budgetformer"):
        difficulty_target_loss([], torch.ones(3))
    with pytest.raises(ValueError, match="not finite"):
        difficulty_target_loss([(0.1, 0.9, torch.ones(2))], torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="per-token"):
        difficulty_target_loss([(0.1, 0.9, torch.ones(2, 5))], torch.ones(2))
    with pytest.raises(ValueError, match="budget_target"):
        RunConfig(budget_target=-1.0)


def test_train_step_adds_the_target_to_the_papers_loss() -> None:
    """The loss a training step minimises, against cross-entropy + aux + W * the target written out in float64."""
    mcfg = ModelConfig(vocab_size=30, num_classes=3, d_model=16, num_heads=4, d_ff=32, num_layers=2, max_len=12,
                       dropout=0.0)
    cfg = RunConfig(method="budgetformer", method_options={"s_min": 0.1, "s_max": 0.5}, budget_target=3.0,
                    max_steps=1, lr=1e-3)
    torch.manual_seed(0)
    model: EncoderClassifier = build_model(mcfg, cfg).train()
    ids, mask = torch.randint(1, 30, (6, 10)), torch.ones(6, 10, dtype=torch.bool)
    labels = torch.randint(0, 3, (6,))

    seen: list[torch.Tensor] = []
    hooks = [r.condcomp_policy.register_forward_hook(lambda m, a, out: seen.append(out.s))
             for r in routed_modules(model).values()]
    torch.manual_seed(1)  # the routers' exploration noise: the same draw in both forwards
    logits = model(ids, mask, None)
    for h in hooks:
        h.remove()
    example = F.cross_entropy(logits.double(), labels, reduction="none")
    rank = torch.as_tensor(stats.rankdata(example.detach().numpy()), dtype=torch.float64) - 1
    target = 0.1 + 0.4 * rank / 5
    by_hand = example.mean() + condcomp.aux_loss(model).double() + 3.0 * torch.stack(
        [((s.double() - target) ** 2).mean() for s in seen]).mean()

    opt = make_optimizer(model, cfg)
    budgets: list[tuple[object, torch.Tensor]] = []
    step_hooks = [r.condcomp_policy.register_forward_hook(lambda m, a, out: budgets.append((m, out.s)))
                  for r in routed_modules(model).values()]
    torch.manual_seed(1)
    got = _train_step(model, (ids, mask, None, labels), opt, make_scheduler(opt, cfg, 1, 0), cfg, budgets)
    for h in step_hooks:
        h.remove()
    assert len(seen) == 2 and budgets == []  # both layers counted, the list emptied for the next step
    assert got == pytest.approx(float(by_hand.detach()), rel=1e-5)
    assert float(3.0 * torch.stack([((s.double() - target) ** 2).mean() for s in seen]).mean()) > 1e-4
