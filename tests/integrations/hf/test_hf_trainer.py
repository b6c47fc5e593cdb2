"""A real ``transformers.Trainer`` run with ``CondCompCallback``: the budget hinge must move s (and without the
callback it does not), the schedules follow the steps, usage is logged, and the model Trainer saves reloads routed.

Reference for "moves": the same run without the callback (task loss alone), from the same initial weights.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import condcomp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install condcomp[hf])")

from condcomp.integrations.hf import CondCompCallback  # noqa: E402
from condcomp.integrations.hf.checkpoint import from_pretrained  # noqa: E402

# The hinge pulls s (initialised at 0.6) into [0.1, 0.2]; a large weight makes 12 steps enough to see it.
CFG = condcomp.CondCompConfig(policy=("budgetformer", {"s_min": 0.1, "s_max": 0.2, "budget_weight": 50.0}),
                              router="topk")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                  vocab_size=100, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg)
    condcomp.apply_(model, CFG)
    return model


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": torch.tensor(i % 2)} for i in range(32)]


def _train(model: torch.nn.Module, out: Path, callbacks: list[object]) -> transformers.Trainer:
    args = transformers.TrainingArguments(str(out), max_steps=12, per_device_train_batch_size=8, learning_rate=5e-2,
                                          logging_steps=4, save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(), callbacks=callbacks)
    trainer.train()
    return trainer


def _s_mean(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.stack([d["input_ids"] for d in _data()]))
    usage = condcomp.head_usage(model)
    return sum(u.s_mean for u in usage.values()) / len(usage)


@pytest.mark.slow
def test_the_callback_trains_the_budget_steps_schedules_and_logs(tmp_path: Path) -> None:
    start = _s_mean(_model())
    plain = _model()
    _train(plain, tmp_path / "plain", [])
    with_cb = _model()
    trainer = _train(with_cb, tmp_path / "cb", [CondCompCallback()])
    # With the callback s ends near the hinge's interval; the task loss alone does not take it there.
    assert start > 0.55 and _s_mean(with_cb) < 0.25 and _s_mean(plain) > 0.4, (start, _s_mean(with_cb),
                                                                                   _s_mean(plain))
    assert [h.progress for h in condcomp.api.routing_hosts(with_cb).values()] == [1.0, 1.0]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all({"condcomp/s_mean", "condcomp/k_frac", "condcomp/flop_frac"} <= set(h) for h in logged)

    # The folder Trainer writes (its own save_pretrained) reloads routed, with equal outputs.
    trainer.save_model(str(tmp_path / "saved"))
    loaded = from_pretrained(transformers.BertForSequenceClassification, tmp_path / "saved").eval()
    ids = torch.stack([d["input_ids"] for d in _data()])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, with_cb.eval()(input_ids=ids).logits)


def test_the_callback_refuses_an_unwrapped_model(tmp_path: Path) -> None:
    model = copy.deepcopy(_model())
    condcomp.remove_(model)
    with pytest.raises(ValueError, match="has no condcomp routing"):
        _train(model, tmp_path, [CondCompCallback()])
