"""``CondCompCallback`` under gradient accumulation: one optimizer step over N micro-batches must equal a hand-written
step, for a model that takes loss kwargs (Trainer passes ``num_items_in_batch`` and does not divide) and for one
that does not (Trainer divides the whole loss by N).

Reference: the same initial model, the same micro-batches (recorded as the Trainer fed them), the loss written out
with torch: the causal-LM cross-entropy and ``condcomp.aux_loss`` of each micro-batch, each micro-batch weighted as
transformers weights its task loss (its share of the step's label count, or 1/N), gradients accumulated, then one
plain SGD step. Micro-batches hold different numbers of ``-100`` labels so that the two weightings differ.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import condcomp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install condcomp[hf])")

from condcomp.integrations.hf import CondCompCallback  # noqa: E402

CFG = condcomp.CondCompConfig(policy=("budgetformer", {"s_min": 0.1, "s_max": 0.2, "budget_weight": 50.0}),
                              router=("topk", {"noise_std": 0.0}))
LR, BATCH, T, VOCAB = 0.5, 2, 8, 50


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=37, vocab_size=VOCAB, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    condcomp.apply_(model, CFG)
    return model


def _data(micro_batches: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(micro_batches * BATCH):
        ids = torch.randint(0, VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[: 1 + (i * i) % 7] = -100  # scored tokens per row: 7, 6, 3, 5, 5, 3, 6, 7
        rows.append({"input_ids": ids, "labels": labels})
    return rows


class _GradSnapshot(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _trainer_step(model: torch.nn.Module, micro_batches: int, out: Path) -> tuple[list[dict[str, torch.Tensor]],
                                                                                   dict[str, torch.Tensor]]:
    seen: list[dict[str, torch.Tensor]] = []

    def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            seen.append({"input_ids": kwargs["input_ids"].clone(), "labels": kwargs["labels"].clone()})

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    snapshot = _GradSnapshot()
    args = transformers.TrainingArguments(str(out), max_steps=1, per_device_train_batch_size=BATCH,
                                          gradient_accumulation_steps=micro_batches, learning_rate=LR, optim="sgd",
                                          lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(micro_batches),
                                   callbacks=[CondCompCallback(), snapshot])
    trainer.train()
    handle.remove()
    assert len(seen) == micro_batches
    return seen, snapshot.grads


def _hand_step(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], loss_kwargs: bool) -> None:
    condcomp.set_progress(model, 0.0)
    model.train()
    n_total = sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in batches)
    for b in batches:
        logits = model(input_ids=b["input_ids"]).logits[:, :-1]  # (B, T-1, V): position t predicts token t+1
        targets = b["labels"][:, 1:]
        ce_sum = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum")
        n_i = int(targets.ne(-100).sum())
        if loss_kwargs:  # each micro-batch weighted by its share of the step's scored tokens
            loss = ce_sum / n_total + condcomp.aux_loss(model) * (n_i / n_total)
        else:  # each micro-batch's mean, over the number of micro-batches
            loss = (ce_sum / n_i + condcomp.aux_loss(model)) / len(batches)
        loss.backward()


@pytest.mark.slow
@pytest.mark.parametrize("loss_kwargs", [True, False], ids=["loss_kwargs", "no_loss_kwargs"])
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_one_accumulated_step_equals_a_hand_written_step(tmp_path: Path, loss_kwargs: bool,
                                                          micro_batches: int) -> None:
    trained = _model()
    if not loss_kwargs:
        trained.accepts_loss_kwargs = False  # transformers' switch: Trainer then divides by the micro-batches
    hand = copy.deepcopy(trained)
    start = {n: p.detach().clone() for n, p in trained.named_parameters()}
    batches, trainer_grads = _trainer_step(trained, micro_batches, tmp_path)

    _hand_step(hand, batches, loss_kwargs)
    routing = [n for n, _ in hand.named_parameters() if "condcomp_" in n]
    assert routing and all(hand.get_parameter(n).grad is not None for n in routing)
    assert any(hand.get_parameter(n).grad.abs().sum() > 0 for n in routing)
    for name, p in hand.named_parameters():
        torch.testing.assert_close(trainer_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
        # The update SGD made: start - lr * the hand-written gradient.
        torch.testing.assert_close(trained.get_parameter(name).detach(), start[name] - LR * p.grad,
                                   rtol=1e-4, atol=1e-6, msg=name)
