"""Training progress is state: saved with the model and restored by every way of loading it.

Reference: the model that never left memory. After ``set_progress(m, p)``, a copy restored from a ``state_dict``,
a condcomp checkpoint or ``deepcopy`` must report ``p`` and give exactly its eval outputs (weighted gates make the
output depend on the temperature schedule, so a progress lost to 0.0 changes the output).
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import condcomp

CFG = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"gates": "weighted"}),
                              executor="reference")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(condcomp.HeadAttention(32, 4), condcomp.HeadAttention(32, 4))
    condcomp.apply_(model, CFG)
    return model.eval()


def _out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _progress(model: nn.Module) -> list[float]:
    return [h.progress for h in condcomp.api.routing_hosts(model).values()]


def test_lost_progress_would_change_the_output() -> None:
    """The premise of the tests below: the schedules move the eval output."""
    x = torch.randn(2, 5, 32)
    model = _model()
    at_zero = _out(model, x)
    condcomp.set_progress(model, 0.8)
    assert not torch.allclose(_out(model, x), at_zero)


def test_state_dict_round_trip_restores_progress() -> None:
    x = torch.randn(2, 5, 32)
    model = _model()
    condcomp.set_progress(model, 0.8)
    want = _out(model, x)
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    assert _progress(fresh) == [0.8, 0.8]
    torch.testing.assert_close(_out(fresh, x), want, atol=0, rtol=0)


def test_condcomp_checkpoint_restores_progress(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    x = torch.randn(2, 5, 32)
    model = _model()
    condcomp.set_progress(model, 0.35)
    want = _out(model, x)
    condcomp.save_checkpoint(tmp_path / "ckpt", model)
    fresh = _model()
    condcomp.load_checkpoint(tmp_path / "ckpt", fresh)
    assert _progress(fresh) == [0.35, 0.35]
    torch.testing.assert_close(_out(fresh, x), want, atol=0, rtol=0)


def test_progress_survives_deepcopy_pickling_and_casts() -> None:
    x = torch.randn(2, 5, 32)
    model = _model()
    condcomp.set_progress(model, 0.6)
    want = _out(model, x)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert _progress(other) == [0.6, 0.6]
        torch.testing.assert_close(_out(other, x), want, atol=0, rtol=0)
    model.half().double()  # progress is an integer buffer: no float cast rounds it
    assert _progress(model) == [0.6, 0.6]


def test_set_progress_refuses_values_outside_the_unit_interval() -> None:
    model = _model()
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="progress must be in"):
            condcomp.set_progress(model, bad)
    assert _progress(model) == [0.0, 0.0]


def test_editing_the_config_after_apply_does_not_change_the_wrapped_model() -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random")
    model = nn.Sequential(condcomp.HeadAttention(16, 2))
    condcomp.apply_(model, cfg)
    cfg.policy[1]["fraction"] = 0.25
    cfg.executor = "masked"
    saved = model[0].condcomp_config
    assert saved.policy == ("fixed", {"fraction": 0.5}) and saved.executor == "auto"


def test_a_checkpoint_without_progress_buffers_loads(tmp_path: Path) -> None:
    """A checkpoint without condcomp_progress keys loads: weights exactly, the model's progress kept."""
    pytest.importorskip("safetensors")
    x = torch.randn(2, 5, 32)
    model = _model()
    want = _out(model, x)

    class WithoutProgress(nn.Module):  # the state without the progress buffers
        def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return {k: v for k, v in model.state_dict().items() if not k.endswith("condcomp_progress")}

    condcomp.save_checkpoint(tmp_path / "old", WithoutProgress())
    fresh = _model()
    condcomp.set_progress(fresh, 0.0)
    condcomp.load_checkpoint(tmp_path / "old", fresh)
    assert _progress(fresh) == [0.0, 0.0]
    torch.testing.assert_close(_out(fresh, x), want, atol=0, rtol=0)
    with pytest.raises(condcomp.checkpoint.CheckpointError, match="missing keys"):  # other keys stay required
        class Partial(nn.Module):
            def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
                return {k: v for k, v in model.state_dict().items() if "scorer" not in k}

        condcomp.save_checkpoint(tmp_path / "partial", Partial())
        condcomp.load_checkpoint(tmp_path / "partial", _model())
