"""Checkpoints without pickle: safetensors for tensors, JSON for everything else, validated before loading.

A checkpoint is a directory:

- ``model.safetensors``: the model's ``state_dict``, each distinct tensor once (a policy shared by all layers is
  stored under its first name; the other names are aliases recorded in ``condcomp.json``);
- ``optimizer.safetensors`` (optional): every tensor of ``optimizer.state_dict()``, flattened to string keys;
- ``train_state.safetensors`` (optional): tensors found inside ``train_state`` (e.g. an RNG state);
- ``condcomp.json``: format version, the user config, the non-tensor parts of ``train_state`` and of the
  optimizer state, an index of every tensor (name, shape, dtype) and the size and SHA-256 of every file.

``condcomp.json`` is written last and lists the checksums of the files next to it, so it is the commit record:
a crash before it is renamed into place leaves the previous checkpoint valid, and a crash in between (only
possible when overwriting an existing checkpoint) is detected as a checksum mismatch, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.files import FileError
from condcomp.host import PROGRESS_BUFFER
from condcomp.staged_files import StagedDirectory

FORMAT = "condcomp-checkpoint"
VERSION = 1
MANIFEST = "condcomp.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "train_state.safetensors"

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
)}


class CheckpointError(FileError):
    """A checkpoint is missing, truncated, corrupt or does not match the model; the message names file and problem."""


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("condcomp checkpoints need safetensors: pip install 'condcomp[experiments]' "
                          "(or pip install safetensors)") from e
    return st


def _encode(obj: Any, prefix: str, tensors: dict[str, Tensor]) -> Any:
    """JSON skeleton of ``obj``; tensors move to ``tensors`` under path-like keys (JSON has no int keys/tuples)."""
    if isinstance(obj, Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and "__tensor__" not in obj:
            return {k: _encode(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
        if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            return {"__items__": [[k, _encode(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
        raise TypeError(f"{prefix}: dictionary keys must be str or int to be saved, got {list(obj)[:5]}")
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{prefix}: cannot save a {type(obj).__name__} without pickle; use JSON values or tensors")


def _decode(obj: Any, tensors: dict[str, Tensor], file: str) -> Any:
    try:
        return _decode_value(obj, tensors, file)
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: the structure recorded in {MANIFEST} is malformed ({e})") from e


def _decode_value(obj: Any, tensors: dict[str, Tensor], file: str) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            if obj["__tensor__"] not in tensors:
                raise CheckpointError(f"{file}: tensor {obj['__tensor__']!r} named in {MANIFEST} is missing")
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__items__"}:
            return {k: _decode_value(v, tensors, file) for k, v in obj["__items__"]}
        if set(obj) == {"__tuple__"}:
            return tuple(_decode_value(v, tensors, file) for v in obj["__tuple__"])
        return {k: _decode_value(v, tensors, file) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_value(v, tensors, file) for v in obj]
    return obj


def _dedupe(state: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Each distinct tensor once (owning contiguous CPU memory, as safetensors requires) + alias -> name."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in state.items():
        if not isinstance(t, Tensor):
            raise CheckpointError(f"{MODEL_FILE}: state_dict entry {name!r} is a {type(t).__name__}, not a tensor "
                                  "(extra state cannot be saved without pickle)")
        if t.dtype not in _DTYPES.values():
            raise CheckpointError(f"{MODEL_FILE}: {name!r} has dtype {t.dtype}, which checkpoints do not support")
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = t.detach().to("cpu", copy=True).contiguous()
    return unique, aliases


def _index(tensors: dict[str, Tensor]) -> dict[str, dict[str, Any]]:
    return {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in tensors.items()}


def verify_digest(path: Path, expected: Any, manifest_name: str) -> None:
    """Raise :class:`CheckpointError` unless ``path`` has the size and SHA-256 recorded in ``expected``."""
    if not (isinstance(expected, dict) and _is_int(expected.get("bytes")) and isinstance(expected.get("sha256"), str)):
        raise CheckpointError(f"{manifest_name}: the record of {path.name} is malformed")
    actual = file_digest(path)
    if actual["bytes"] != expected["bytes"]:
        raise CheckpointError(f"{path}: truncated or replaced: {actual['bytes']} bytes, {manifest_name} records "
                              f"{expected['bytes']}")
    if actual["sha256"] != expected["sha256"]:
        raise CheckpointError(f"{path}: corrupt: SHA-256 {actual['sha256'][:16]}... does not match the "
                              f"{expected['sha256'][:16]}... recorded in {manifest_name}")


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of a file (what manifests record to detect truncation and corruption)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


# ----------------------------------------------------------------------------------------------- saving


def save_checkpoint(directory: str | os.PathLike[str], model: nn.Module, config: dict[str, Any] | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    train_state: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (and optionally ``optimizer`` and ``train_state``) to ``directory``; returns its path.

    ``config`` (JSON values; a ``CondCompConfig`` is converted with ``to_dict``) and ``train_state`` (JSON values
    and tensors, e.g. ``{"step": 10, "rng": torch.get_rng_state()}``) come back from :func:`load_checkpoint`.

    >>> import tempfile, condcomp
    >>> layer = condcomp.HeadAttention(8, 2)
    >>> path = save_checkpoint(tempfile.mkdtemp() + "/ckpt", layer, {"lr": 1e-3})
    >>> load_checkpoint(path, condcomp.HeadAttention(8, 2))["config"]
    {'lr': 0.001}
    """
    st = _safetensors()
    directory = Path(directory)
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()
    files, manifest = _contents(model, config, optimizer, train_state)
    # an existing checkpoint loses the optional files this save does not write
    with StagedDirectory(directory, remove=[f for f in (OPTIMIZER_FILE, STATE_FILE) if f not in files]) as stage:
        for name, tensors in files.items():
            tmp = stage.path(name)
            st.save_file(tensors, str(tmp), metadata={"format": FORMAT})
            manifest["files"][name] = file_digest(tmp)
        # staged last, so renamed last: the manifest commits the files listed in it
        stage.path(MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return directory


def _contents(model: nn.Module, config: dict[str, Any] | None, optimizer: torch.optim.Optimizer | None,
              train_state: dict[str, Any] | None) -> tuple[dict[str, dict[str, Tensor]], dict[str, Any]]:
    """The tensors of each file to write, and the manifest (its ``files`` digests filled in as they are written);
    a config that is not JSON fails here, before anything is written."""
    files: dict[str, dict[str, Tensor]] = {}
    files[MODEL_FILE], aliases = _dedupe(model.state_dict())
    optim_skeleton = state_skeleton = None
    if optimizer is not None:
        optim_skeleton, files[OPTIMIZER_FILE] = _split_tensors(optimizer.state_dict(), "optimizer")
    if train_state is not None:
        state_skeleton, state_tensors = _split_tensors(train_state, "train_state")
        if state_tensors:
            files[STATE_FILE] = state_tensors
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "torch_version": torch.__version__,
        "config": config, "train_state": state_skeleton, "optimizer": optim_skeleton, "aliases": aliases,
        "tensors": {f: _index(t) for f, t in files.items()}, "files": {},
    }
    try:
        json.dumps(manifest["config"], allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: config must hold JSON values only: {e}") from e
    return files, manifest


def _split_tensors(obj: Any, prefix: str) -> tuple[Any, dict[str, Tensor]]:
    """``obj``'s JSON skeleton and its tensors, copied to contiguous CPU memory (what safetensors writes)."""
    tensors: dict[str, Tensor] = {}
    skeleton = _encode(obj, prefix, tensors)
    return skeleton, {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


# ----------------------------------------------------------------------------------------------- loading


def _read_manifest(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (not a condcomp checkpoint, or the save did not finish)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a condcomp checkpoint manifest (format={manifest.get('format')!r})"
                              if isinstance(manifest, dict) else f"{path}: not a condcomp checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('version')!r}, this condcomp reads {VERSION}")
    for key in ("files", "tensors", "aliases"):
        if not isinstance(manifest.get(key), dict):
            raise CheckpointError(f"{path}: field {key!r} is missing or malformed")
    _check_manifest_fields(manifest, path)
    return manifest


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest_fields(manifest: dict[str, Any], path: Path) -> None:
    """Every field of the manifest has the type the loader reads (a hand-edited or corrupted manifest is named)."""
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and _is_int(entry.get("bytes")) and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{path}: files[{name!r}] is malformed (expected bytes: int, sha256: str)")
    for name, index in manifest["tensors"].items():
        if not isinstance(index, dict):
            raise CheckpointError(f"{path}: tensors[{name!r}] is malformed (expected a name -> shape/dtype table)")
        for key, want in index.items():
            shape = want.get("shape") if isinstance(want, dict) else None
            if (not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape)
                    or want.get("dtype") not in _DTYPES):
                raise CheckpointError(f"{path}: tensors[{name!r}][{key!r}] is malformed (expected shape: list of "
                                      f"int, dtype: one of {sorted(_DTYPES)})")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in manifest["aliases"].items()):
        raise CheckpointError(f"{path}: aliases is malformed (expected name -> name)")
    for key in ("config", "optimizer"):
        if manifest.get(key) is not None and not isinstance(manifest[key], dict):
            raise CheckpointError(f"{path}: field {key!r} is malformed (expected an object or null)")


def read_checkpoint_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config`` dict saved with the checkpoint (to rebuild the model before loading into it)."""
    config = _read_manifest(Path(directory)).get("config")
    return config if config is not None else {}


def _read_tensors(directory: Path, name: str, manifest: dict[str, Any]) -> dict[str, Tensor]:
    st = _safetensors()
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
    verify_digest(path, manifest["files"].get(name), MANIFEST)
    try:
        tensors = st.load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError for malformed headers
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e
    index = manifest["tensors"].get(name, {})
    if set(index) != set(tensors):
        missing, extra = sorted(set(index) - set(tensors)), sorted(set(tensors) - set(index))
        raise CheckpointError(f"{path}: tensors do not match {MANIFEST}: missing {missing[:5]}, extra {extra[:5]}")
    for key, t in tensors.items():
        want = index[key]
        if list(t.shape) != want["shape"] or str(t.dtype).removeprefix("torch.") != want["dtype"]:
            raise CheckpointError(f"{path}: {key!r} is {tuple(t.shape)} {t.dtype}, {MANIFEST} records "
                                  f"{tuple(want['shape'])} {want['dtype']}")
    return tensors


def _check_model(path: Path, state: dict[str, Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    # A checkpoint without progress buffers loads and keeps the model's current progress.
    missing = [k for k in expected if k not in state and not k.endswith(PROGRESS_BUFFER)]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = [f"{what}: {keys[:8]}{' ...' if len(keys) > 8 else ''}" for what, keys in
                 (("missing keys the model expects", missing), ("unexpected keys", unexpected)) if keys]
        raise CheckpointError(f"{path}: " + "; ".join(parts) + " (was it saved from a model built with the same "
                              "architecture and condcomp config?)")
    for k, want in expected.items():
        if (got := state.get(k)) is None:
            continue
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: {k!r} has shape {tuple(got.shape)}, the model expects {tuple(want.shape)}")
        if got.dtype != want.dtype:
            raise CheckpointError(f"{path}: {k!r} has dtype {got.dtype}, the model expects {want.dtype} "
                                  "(convert the model with .to(dtype) before loading)")


def _check_optimizer(path: Path, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    groups = optimizer.param_groups
    saved = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(saved, list) or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{path}: malformed optimizer state")
    if not all(isinstance(s, dict) for s in saved) or not all(isinstance(e, dict) for e in state["state"].values()):
        raise CheckpointError(f"{path}: malformed optimizer state (parameter groups and per-parameter state must "
                              "be objects)")
    if len(saved) != len(groups):
        raise CheckpointError(f"{path}: {len(saved)} parameter groups, the optimizer has {len(groups)}")
    params: dict[int, Tensor] = {}
    for i, (s, g) in enumerate(zip(saved, groups)):
        if len(s.get("params", [])) != len(g["params"]):
            raise CheckpointError(f"{path}: parameter group {i} has {len(s.get('params', []))} parameters, the "
                                  f"optimizer's has {len(g['params'])}")
        params.update(zip(s["params"], g["params"]))
    for idx, entry in state["state"].items():
        if idx not in params:
            raise CheckpointError(f"{path}: state for parameter index {idx}, which no parameter group lists")
        p = params[idx]
        for key, value in entry.items():
            # Per-element state (exp_avg, momentum_buffer, ...) has the parameter's shape; factored state
            # (Adafactor's row/column statistics) has fewer dimensions and is not checked here.
            if isinstance(value, Tensor) and value.dim() == p.dim() and value.dim() > 0 and value.shape != p.shape:
                raise CheckpointError(f"{path}: optimizer state {key!r} of parameter {idx} has shape "
                                      f"{tuple(value.shape)}, the parameter is {tuple(p.shape)}")


def _restore_tuples(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    for saved, group in zip(state["param_groups"], optimizer.param_groups):
        for key, value in group.items():
            if isinstance(value, tuple) and isinstance(saved.get(key), list):
                saved[key] = tuple(saved[key])


def load_checkpoint(directory: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``); returns ``{"config": ..., "train_state": ...}``.

    Everything is read and checked first (files present, sizes and checksums, every key, shape and dtype against
    the model and the optimizer); only then are the model and optimizer touched, so a bad checkpoint raises
    :class:`CheckpointError` and leaves them exactly as they were. No pickle is involved.
    """
    directory = Path(directory)
    manifest = _read_manifest(directory)
    if MODEL_FILE not in manifest["files"]:
        raise CheckpointError(f"{directory / MANIFEST}: lists no {MODEL_FILE}")
    model_path = directory / MODEL_FILE
    state: dict[str, Tensor] = dict(_read_tensors(directory, MODEL_FILE, manifest))
    for alias, name in manifest["aliases"].items():
        if name not in state:
            raise CheckpointError(f"{model_path}: alias {alias!r} points at {name!r}, which is not in the file")
        state[alias] = state[name]
    _check_model(model_path, state, model)

    optim_state = None
    if optimizer is not None:
        if manifest.get("optimizer") is None:
            raise CheckpointError(f"{directory}: the checkpoint has no optimizer state (saved without optimizer=)")
        tensors = _read_tensors(directory, OPTIMIZER_FILE, manifest) if OPTIMIZER_FILE in manifest["files"] else {}
        optim_state = _decode(manifest["optimizer"], tensors, str(directory / OPTIMIZER_FILE))
        _check_optimizer(directory / OPTIMIZER_FILE, optim_state, optimizer)
        _restore_tuples(optim_state, optimizer)
    state_tensors = _read_tensors(directory, STATE_FILE, manifest) if STATE_FILE in manifest["files"] else {}
    train_state = _decode(manifest.get("train_state"), state_tensors, str(directory / STATE_FILE))

    # Validation is over: from here on nothing can fail on account of the checkpoint's content.
    if optimizer is not None:
        optimizer.load_state_dict(optim_state)  # type: ignore[arg-type]
    model.load_state_dict(state, strict=True)
    return {"config": manifest.get("config"), "train_state": train_state}
