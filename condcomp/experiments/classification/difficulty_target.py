"""A per-input training signal for a learned budget: a target from each example's own loss.

The paper's loss gives the budget network no per-input signal beyond the task loss's pull through the soft top-k,
and that pull was measured to point towards *fewer* heads on the hardest examples (docs/results.md, "What pulls on
the budget"). ``--budget-target W`` adds, for every routed layer whose policy has a budget interval,

    W * mean_i (s_i - t_i)^2,   t_i = s_min + (s_max - s_min) * rank_i / (B - 1)

where ``rank_i`` is the rank of example i's task loss in its batch (0 = lowest loss; ties share their mean rank),
detached: the hardest example of a batch is asked for ``s_max``, the easiest for ``s_min``. Ranks, not loss
values, because the loss shrinks over training while the interval does not. The budget network must then predict,
from its pooled input, how hard the model finds the example; whether that transfers to test inputs is what the
budget search measures.
"""

from __future__ import annotations

import torch
from torch import Tensor


def loss_rank_targets(example_loss: Tensor, s_min: float, s_max: float) -> Tensor:
    """``(B,)`` targets in ``[s_min, s_max]``, rising with the rank of ``example_loss`` ``(B,)`` in its batch.

    Ties share their mean rank; a batch of one example gets the middle of the interval.

    >>> [round(t, 6) for t in loss_rank_targets(torch.tensor([0.3, 2.0, 0.1]), 0.1, 0.3).tolist()]
    [0.2, 0.3, 0.1]
    """
    if example_loss.dim() != 1:
        raise ValueError(f"example_loss must be (B,), got shape {tuple(example_loss.shape)}")
    loss = example_loss.detach().float()
    B = loss.numel()
    if B == 1:
        return loss.new_full((1,), 0.5 * (s_min + s_max))
    # mean rank among ties: (number below) + (number equal - 1) / 2
    below = (loss[None, :] < loss[:, None]).sum(1).float()
    equal = (loss[None, :] == loss[:, None]).sum(1).float()
    rank = below + (equal - 1) / 2
    return s_min + (s_max - s_min) * rank / (B - 1)


def difficulty_target_loss(budgets: list[tuple[float, float, Tensor]], example_loss: Tensor) -> Tensor:
    """Mean over layers of ``mean_i (s_i - t_i)^2``; ``budgets``: per layer ``(s_min, s_max, s (B,))``.

    Rows whose loss is not finite (none in a sound batch) would corrupt every rank, so they are refused.
    """
    if not budgets:
        raise ValueError("--budget-target needs a learned budget with an interval (method budgetformer); "
                         "this model's policies have none")
    if not torch.isfinite(example_loss).all():
        raise ValueError("--budget-target: a training example's loss is not finite; check the inputs and lr")
    terms = []
    for s_min, s_max, s in budgets:
        if s.shape != example_loss.shape:
            raise ValueError(f"--budget-target needs one budget per example (B,), got s of shape "
                             f"{tuple(s.shape)} for {tuple(example_loss.shape)} examples (a per-token budget?)")
        target = loss_rank_targets(example_loss, s_min, s_max).to(s.device)
        terms.append(((s.float() - target) ** 2).mean())
    return torch.stack(terms).mean()
