"""Checkpoints: round trip, shared parameters, resume == uninterrupted training, and every way a file goes bad."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import TinyNet

import condcomp
from condcomp.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_config, save_checkpoint

pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install condcomp[experiments])")


def _model(seed: int = 0, **kw: object) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kw).eval()  # type: ignore[arg-type]


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, 32, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return x, mask, torch.randint(0, 3, (4,), generator=g)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_outputs_equal_in_a_fresh_model(tmp_path: Path) -> None:
    model = _model(0)
    x, mask, _ = _batch()
    want = model(x, mask)
    path = save_checkpoint(tmp_path / "ckpt", model, {"policy": "learned", "lr": 1e-3}, train_state={"step": 7})
    assert sorted(p.name for p in path.iterdir()) == ["condcomp.json", "model.safetensors"]
    fresh = _model(123)
    assert not torch.equal(fresh(x, mask), want)
    meta = load_checkpoint(path, fresh)
    assert meta == {"config": {"policy": "learned", "lr": 1e-3}, "train_state": {"step": 7}}
    assert torch.equal(fresh(x, mask), want)
    assert read_checkpoint_config(path) == {"policy": "learned", "lr": 1e-3}


def test_shared_policy_is_stored_once_and_stays_shared(tmp_path: Path) -> None:
    model = _model(0, share_policy=True)
    keys = [k for k in model.state_dict() if "condcomp_policy" in k]
    assert len(keys) == 4  # 2 layers x (weight, bias), one module
    path = save_checkpoint(tmp_path / "c", model)
    manifest = json.loads((path / "condcomp.json").read_text())
    assert set(manifest["aliases"]) == {"layers.1.condcomp_policy.proj.weight", "layers.1.condcomp_policy.proj.bias"}
    fresh = _model(5, share_policy=True)
    load_checkpoint(path, fresh)
    assert fresh.layers[0].condcomp_policy is fresh.layers[1].condcomp_policy
    assert _same(fresh.state_dict(), model.state_dict())


def test_condcomp_config_and_tensor_train_state_round_trip(tmp_path: Path) -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random", executor="masked")
    rng = torch.get_rng_state()
    path = save_checkpoint(tmp_path / "c", _model(), cfg, train_state={"rng": rng, "hist": [(1, 2.5)], "n": None})
    out = load_checkpoint(path, _model(1))
    assert condcomp.CondCompConfig.from_dict(out["config"]) == cfg
    assert torch.equal(out["train_state"]["rng"], rng)
    assert out["train_state"]["hist"] == [(1, 2.5)] and out["train_state"]["n"] is None


def _train(model: TinyNet, opt: torch.optim.Optimizer, steps: range) -> None:
    model.train()
    for step in steps:
        x, mask, y = _batch(100 + step)
        loss = torch.nn.functional.cross_entropy(model(x, mask), y) + condcomp.aux_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.slow
def test_optimizer_resume_equals_uninterrupted_training(tmp_path: Path) -> None:
    ref = _model(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, range(6))

    first = _model(0)
    opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(first, opt, range(3))
    path = save_checkpoint(tmp_path / "c", first, optimizer=opt, train_state={"step": 3})
    assert (path / "optimizer.safetensors").is_file()

    resumed = _model(99)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.5)  # the saved lr must win
    meta = load_checkpoint(path, resumed, resumed_opt)
    assert resumed_opt.param_groups[0]["lr"] == 1e-2
    assert resumed_opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
    _train(resumed, resumed_opt, range(meta["train_state"]["step"], 6))
    assert _same(resumed.state_dict(), ref.state_dict())


def test_overwrite_drops_stale_optimizer_file(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, range(1))
    path = save_checkpoint(tmp_path / "c", model, optimizer=opt)
    save_checkpoint(path, model)
    assert not (path / "optimizer.safetensors").exists()
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(path, _model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    assert not list(tmp_path.glob(".*tmp*")) and not list(path.glob(".*tmp*"))


def _saved(tmp_path: Path) -> Path:
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(1))
    return save_checkpoint(tmp_path / "c", model, {"a": 1}, optimizer=opt)


def _expect_untouched(path: Path, match: str, **kw: object) -> None:
    target = _model(42, **kw)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(target.parameters(), lr=1e-3)
    before, opt_before = _snapshot(target), repr(opt.state_dict())
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, target, opt)
    assert _same(target.state_dict(), before), "a failed load modified the model"
    assert repr(opt.state_dict()) == opt_before, "a failed load modified the optimizer"


def test_truncated_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_untouched(path, r"model\.safetensors: truncated")


def test_corrupt_bytes(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    f = path / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data: the header still parses, only the checksum can tell
    f.write_bytes(bytes(data))
    _expect_untouched(path, r"optimizer\.safetensors: corrupt")


def test_missing_file_and_bad_json(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    (path / "model.safetensors").unlink()
    _expect_untouched(path, r"model\.safetensors: missing")
    (path / "condcomp.json").write_text("{not json")
    _expect_untouched(path, r"condcomp\.json: not valid JSON")
    with pytest.raises(CheckpointError, match="condcomp.json: not valid JSON"):
        read_checkpoint_config(path)
    (path / "condcomp.json").unlink()
    _expect_untouched(path, r"condcomp\.json: missing")
    _expect_untouched(tmp_path / "nowhere", "no such checkpoint directory")


def test_wrong_shape_names_key_and_both_shapes(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _expect_untouched(path, r"model\.safetensors: 'layers\.0\.condcomp_router\.score\.weight' has shape \(4, 32\), "
                            r"the model expects \(8, 32\)", num_heads=8)
    torch.manual_seed(0)
    wide = TinyNet(d_model=16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: 'layers\.0\.q_proj\.weight' has shape "
                                              r"\(32, 32\), the model expects \(16, 16\)"):
        load_checkpoint(path, wide)


def test_missing_and_unexpected_keys(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _expect_untouched(path, r"missing keys the model expects: \['layers\.2\.", layers=3)
    _expect_untouched(path, r"unexpected keys: \['layers\.1\.", layers=1)


def test_wrong_dtype(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    target = _model(3).double()
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=r"has dtype torch\.float32, the model expects torch\.float64"):
        load_checkpoint(path, target)
    assert _same(target.state_dict(), before)


def test_optimizer_mismatch(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    target = _model(1)
    params = list(target.parameters())
    opt = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:]}], lr=1e-3)
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match="1 parameter groups, the optimizer has 2"):
        load_checkpoint(path, target, opt)
    assert _same(target.state_dict(), before)


def test_unsaveable_values_fail_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="JSON values"):
        save_checkpoint(tmp_path / "c", _model(), {"f": object()})
    with pytest.raises(TypeError, match="without pickle"):
        save_checkpoint(tmp_path / "d", _model(), train_state={"f": object()})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("field,value", [
    ("files", {"model.safetensors": "abc"}),
    ("files", {"model.safetensors": {"bytes": "10", "sha256": "x"}}),
    ("tensors", {"model.safetensors": []}),
    ("tensors", {"model.safetensors": {"w": {"shape": "3", "dtype": "float32"}}}),
    ("tensors", {"model.safetensors": {"w": {"shape": [3], "dtype": "complex64"}}}),
    ("aliases", {"a": 3}),
    ("config", [1, 2]),
    ("optimizer", "adam"),
    ("optimizer", {"state": {"0": 5}, "param_groups": [3]}),
    ("train_state", {"__items__": 7}),
    ("train_state", {"__tensor__": ["not", "a", "name"]}),
])
def test_malformed_manifest_fields_raise_checkpoint_error(tmp_path: Path, field: str, value: object) -> None:
    """Every hand-edited or corrupted manifest field is a CheckpointError naming the file, never a bare
    AttributeError/TypeError from deep inside the loader."""
    path = _saved(tmp_path)
    manifest = json.loads((path / "condcomp.json").read_text())
    if field == "files":  # keep the other files' records: only the edited one is malformed
        manifest["files"].update(value)  # type: ignore[arg-type]
    else:
        manifest[field] = value
    (path / "condcomp.json").write_text(json.dumps(manifest))
    _expect_untouched(path, r"condcomp\.json|malformed")
