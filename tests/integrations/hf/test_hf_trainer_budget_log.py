"""What the Trainer callback logs during BudgetFormer training: the budget and the heads it allows, which is
what inference computes (the training forward itself computes every head, so its k_frac is 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")


def test_budget_k_frac_is_what_an_eval_forward_computes() -> None:
    from condcomp.integrations.hf import CondCompCallback

    torch.manual_seed(0)
    model = nn.Sequential(condcomp.HeadAttention(32, 8), condcomp.HeadAttention(32, 8))
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("budgetformer", {"init_s": 0.45}), router="topk"))
    x = torch.randn(6, 5, 32)
    model.train()
    model(x)
    logs: dict[str, float] = {}
    state = SimpleNamespace(log_history=[], global_step=0)
    CondCompCallback().on_log(None, state, None, logs=logs, model=model)
    assert logs["condcomp/k_frac"] == 1.0  # training computes every head (soft top-k weights)
    model.eval()
    with torch.no_grad():
        model(x)
    eval_k = [u.k_frac for u in condcomp.head_usage(model).values()]
    assert logs["condcomp/budget_k_frac"] == pytest.approx(sum(eval_k) / len(eval_k))
    assert logs["condcomp/budget_k_frac"] < 1.0
