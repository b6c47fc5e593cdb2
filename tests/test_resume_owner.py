"""A resumable checkpoint knows the model, command and settings it belongs to, and refuses any other.

Red team round 5, item 2: ``calibrate-kv --model B --out f`` after an interrupted ``--model A --out f`` continued A's
gates when the shapes matched (0.026 off B's own run). Item 9: resuming gate training for another layer count
surfaced torch's bare ``load_state_dict`` size-mismatch ``RuntimeError``, naming no file. The exact resume of the
same run is tests/test_resume.py's (and test_duo_gates' resume at the last step).

Oracle: the run B would make from scratch (a refused resume leaves nothing half-continued), and the differences
written out by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from condcomp.resume import ResumeError, ResumeFile, model_identity

t = pytest.importorskip("transformers")

T, SINKS, WINDOW = 12, 2, 3


def llama(seed: int, layers: int = 2, name: str = "") -> nn.Module:
    torch.manual_seed(seed)
    config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    config._name_or_path = name
    return t.LlamaForCausalLM(config).eval()


def rows() -> list[list[int]]:
    return torch.randint(1, 97, (3, T), generator=torch.Generator().manual_seed(4)).tolist()


def settings(steps: int) -> object:
    from condcomp.kv.calibration import DuoSettings

    return DuoSettings(steps=steps, seq_len=T, lr=0.3, l1=1.0, sinks=SINKS, window=WINDOW)


def interrupted(model: nn.Module, path: Path) -> None:
    """A run of 20 steps stopped after its checkpoint at step 10 (the checkpoint a Ctrl-C leaves)."""
    from condcomp.kv.calibration import train_gates

    train_gates(model, rows(), settings(10), checkpoint=path)  # type: ignore[arg-type]
    assert path.is_file()


@pytest.mark.parametrize("other, differs", [
    (lambda: llama(1), ["weights"]),  # the same shapes, config and name: only the weights tell them apart
    (lambda: llama(0, name="org/model-b"), ["model"]),
])
def test_another_model_of_the_same_shapes_is_refused(tmp_path: Path, other: object, differs: list[str]) -> None:
    from condcomp.kv.calibration import train_gates

    ckpt = tmp_path / "gates.partial.pt"
    interrupted(llama(0), ckpt)
    saved = ckpt.read_bytes()
    model_b = other()  # type: ignore[operator]
    with pytest.raises(ResumeError) as caught:
        train_gates(model_b, rows(), settings(20), checkpoint=ckpt)  # type: ignore[arg-type]
    message = str(caught.value)
    assert str(ckpt) in message and f"Delete {ckpt}" in message and "belongs to another model" in message
    named = re.findall(r"(?:^|; |\()(\w+) .*? there, .*? now", message)
    assert named == differs, message  # each difference named, and only those
    assert ckpt.read_bytes() == saved  # refused before anything was written
    ckpt.unlink()  # as the message says: start over, and B's run is B's own
    fresh, _ = train_gates(llama(1) if differs == ["weights"] else llama(0, name="org/model-b"), rows(),
                           settings(20))  # type: ignore[arg-type]
    again, _ = train_gates(model_b, rows(), settings(20), checkpoint=ckpt)  # type: ignore[arg-type]
    assert torch.equal(again.alpha, fresh.alpha)


def test_another_layer_count_is_refused_with_the_path_not_a_size_mismatch(tmp_path: Path) -> None:
    from condcomp.kv.calibration import train_gates

    ckpt = tmp_path / "gates.partial.pt"
    interrupted(llama(0), ckpt)
    two, three = (sum(p.numel() for p in llama(0, layers=n).parameters()) for n in (2, 3))
    with pytest.raises(ResumeError, match=re.escape(str(ckpt)) + r" belongs to another model or command \(config "
                                          rf".*; layers 2 there, 3 now; parameters {two} there, {three} now; .*Delete"):
        train_gates(llama(0, layers=3), rows(), settings(20), checkpoint=ckpt)  # type: ignore[arg-type]


def test_a_checkpoint_whose_tensors_do_not_fit_is_refused_before_load_state_dict(tmp_path: Path) -> None:
    """Even with the owner and settings matching (an edited or foreign file), torch's size error never surfaces."""
    from condcomp.kv.calibration import train_gates

    ckpt = tmp_path / "gates.partial.pt"
    model = llama(0)
    interrupted(model, ckpt)
    state = torch.load(ckpt, weights_only=True)
    (key,) = state["trainable"]
    state["trainable"][key] = torch.ones(3, 2)
    torch.save(state, ckpt)
    with pytest.raises(ResumeError, match=re.escape(str(ckpt)) + r": the trained state does not fit this run "
                                          rf"\(shapes differ: {key} \(3, 2\) there, \(2, 2\) now\); delete"):
        train_gates(model, rows(), settings(20), checkpoint=ckpt)  # type: ignore[arg-type]


def test_another_command_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    model = nn.Linear(3, 2)
    ResumeFile(path, {"lr": 0.1}, owner={"command": "tune-llm", **model_identity(model)}).save({"step": 1})
    with pytest.raises(ResumeError, match=r"command 'tune-llm' there, 'dit' now"):
        ResumeFile(path, {"lr": 0.1}, owner={"command": "dit", **model_identity(model)}).load()
    assert ResumeFile(path, {"lr": 0.1}, owner={"command": "tune-llm", **model_identity(model)}).load() is not None


def test_the_identity_reads_the_name_config_and_shapes_and_only_asked_the_weights() -> None:
    a, b = llama(0, name="a"), llama(1, name="a")
    assert model_identity(a) == model_identity(b)  # values not asked: a trained model's checkpoint still matches
    assert model_identity(a, values=True)["weights"] != model_identity(b, values=True)["weights"]
    assert model_identity(a, values=True) == model_identity(llama(0, name="a"), values=True)
    ident = model_identity(a)
    assert ident["model"] == "a" and ident["layers"] == 2
    assert ident["parameters"] == sum(p.numel() for p in a.parameters())
    wider = llama(0, name="a")
    wider.config.rope_theta = 500.0  # type: ignore[union-attr]  # the same shapes, another config
    assert model_identity(wider)["config"] != ident["config"] and model_identity(wider)["shapes"] == ident["shapes"]


def test_a_checkpoint_that_records_no_owner_is_refused(tmp_path: Path) -> None:
    """Written before checkpoints knew their model: which model it belongs to cannot be told, so it is refused."""
    path = tmp_path / "run.pt"
    ResumeFile(path, {"lr": 0.1}).save({"step": 1})
    with pytest.raises(ResumeError, match=re.escape(str(path)) + " was written by an older condcomp that did not "
                                          "record the model.*delete"):
        ResumeFile(path, {"lr": 0.1}, owner={"command": "dit", **model_identity(nn.Linear(2, 2))}).load()


def test_tune_llm_refuses_the_checkpoint_of_another_model_or_layer_count(tmp_path: Path) -> None:
    from condcomp.experiments.llm.tuning import TuneSettings, make_trainable, tune

    settings = TuneSettings(seq_len=12, prompt_len=4, batch_size=2, steps=4, warmup=1, tune="attention",
                            eval_seqs=1, checkpoint_every=1, lr=1e-2)
    data = torch.randint(3, 97, (6, 12), generator=torch.Generator().manual_seed(3))
    ckpt = tmp_path / "tuned.pt"
    tune(make_trainable(llama(0, name="org/a"), settings), data, settings, ckpt, stop_after=1)
    saved = ckpt.read_bytes()
    with pytest.raises(ResumeError, match=re.escape(str(ckpt)) + r" belongs to another model or command "
                                          r"\(model 'org/a' there, 'org/b' now\).*Delete"):
        tune(make_trainable(llama(0, name="org/b"), settings), data, settings, ckpt)
    with pytest.raises(ResumeError, match=r"layers 2 there, 3 now"):
        tune(make_trainable(llama(0, layers=3, name="org/a"), settings), data, settings, ckpt)
    assert ckpt.read_bytes() == saved
    resumed = tune(make_trainable(llama(0, name="org/a"), settings), data, settings, ckpt)  # its own model: resumed
    assert resumed["step"] == 4 and len(resumed["history"]) == 4
