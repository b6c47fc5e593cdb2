"""Saving and restoring a condcomp-wrapped transformers model beside its ``save_pretrained`` weights.

The directory ``save_pretrained`` writes stays a plain transformers checkpoint that any code can load (the
routing parameters are left out of ``model.safetensors``); condcomp adds two files beside it:

- ``condcomp_config.json``: the :class:`~condcomp.CondCompConfig` (policy, router, executor, targets), or, for a
  model wrapped by several ``apply_`` calls with different configs (e.g. static pruning, one call per layer), the
  routing record: each config with the exact modules it wrapped (:mod:`condcomp.record`);
- ``condcomp_routing.safetensors``: the routing parameters and buffers (``...condcomp_policy.*``,
  ``...condcomp_router.*``, ``...condcomp_progress``), each distinct tensor once (a shared policy is stored under
  its first name);
- ``condcomp_manifest.json``: the size and SHA-256 of the routing file, checked before it is loaded.

:func:`from_pretrained` is the one-call restore: load the weights, wrap with the saved config, load the routing.
As transformers' own ``from_pretrained`` does, it loads a base model (``LlamaModel``) from a folder saved with a
head (``LlamaForCausalLM``) and the reverse: the saved module names are mapped through ``base_model_prefix``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from condcomp.api import apply_, remove_, routed_modules
from condcomp.checkpoint import CheckpointError, file_digest, verify_digest
from condcomp.config import CondCompConfig
from condcomp.files import FileError, describe, field, read_json, read_json_object
from condcomp.record import RECORD_VERSION, routing_record, store_record_in_config

CONFIG_FILE = "condcomp_config.json"
ROUTING_FILE = "condcomp_routing.safetensors"
MANIFEST_FILE = "condcomp_manifest.json"  # size and SHA-256 of the routing file, written after it
_MARKERS = ("condcomp_policy.", "condcomp_router.", "condcomp_progress")
_PROGRESS = ".condcomp_progress"  # one per wrapped module: the routing file's list of wrapped modules
_SAVE_AGAIN = "save the model again with condcomp.integrations.hf.checkpoint.save_pretrained"


def _is_routing(key: str) -> bool:
    return any(m in key for m in _MARKERS)


def routing_state(model: nn.Module) -> dict[str, Tensor]:
    """The routing tensors of a wrapped model, each distinct tensor once (first name wins), detached on CPU."""
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for key, t in model.state_dict(keep_vars=False).items():
        if not _is_routing(key):
            continue
        ident = (t.data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and ident in seen:
            continue
        seen.add(ident)
        out[key] = t.detach().to("cpu").contiguous()
    return out


def save_condcomp(model: nn.Module, directory: str | os.PathLike[str], config: CondCompConfig | None = None) -> Path:
    """Write ``condcomp_config.json`` and ``condcomp_routing.safetensors`` for a wrapped ``model``.

    ``config`` defaults to what ``apply_`` wrapped the model with: its one config, or, when ``apply_`` calls used
    different configs (one per layer, say), each config with the modules it wrapped. A ``config`` given here
    replaces the config of every wrapped module on reload (a warning names the modules it changes).
    """
    from safetensors.torch import save_file

    routed = routed_modules(model)
    if not routed:
        raise ValueError("save_condcomp: the model has no RoutedAttention; call condcomp.apply_(model, cfg) first")
    if config is None:
        configs = {m.condcomp_config.to_json() for m in routed.values() if m.condcomp_config is not None}
        # one config: stored as such (it finds its modules again); several: each with the modules it wrapped
        text = configs.pop() if len(configs) == 1 else json.dumps(routing_record(model), indent=1)
    else:
        changed = [n for n, m in routed.items()
                   if m.condcomp_config is not None and m.condcomp_config.to_json() != config.to_json()]
        if changed:
            warnings.warn(f"save_condcomp: config= replaces the config these modules were wrapped with: {changed}; "
                          "they reload with it (omit config= to save each module's own config)", stacklevel=2)
        text = json.dumps({"version": RECORD_VERSION, "groups": [{"config": config.to_dict(),
                                                                 "modules": sorted(routed)}]}, indent=1)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(routing_state(model), str(directory / ROUTING_FILE), metadata={"format": "condcomp-routing"})
    (directory / CONFIG_FILE).write_text(text)
    digest = file_digest(directory / ROUTING_FILE)
    manifest = {"format": "condcomp-routing", "version": 1, "files": {ROUTING_FILE: digest}}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return directory


def load_condcomp(model: nn.Module, directory: str | os.PathLike[str]) -> list[str]:
    """Wrap an unwrapped ``model`` with the config (or record) saved in ``directory`` and load its routing.

    The modules wrapped are those the routing file holds (mapped through ``base_model_prefix`` when ``model`` is
    the base model of the saved one, or the reverse). Returns the wrapped module names. Raises if the files are
    missing or the routing tensors do not match the wrapped model (names or shapes), leaving the model unwrapped.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path, routing_path = directory / CONFIG_FILE, directory / ROUTING_FILE
    for path in (cfg_path, routing_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: was the model saved with "
                                    "condcomp.integrations.hf.checkpoint.save_pretrained / save_condcomp?")
    _verify_routing_file(directory)
    stored = read_json_object(cfg_path, "condcomp's routing config (condcomp_config.json)", _SAVE_AGAIN)
    try:
        saved = load_file(str(routing_path))
    except Exception as e:  # safetensors raises its own error type for malformed headers
        raise CheckpointError(f"{routing_path}: unreadable safetensors file ({e})") from e
    if isinstance(stored, dict) and "groups" in stored:
        record = stored
    else:
        config = _config_from(cfg_path, stored)
        modules = sorted(k[: -len(_PROGRESS)] for k in saved if k.endswith(_PROGRESS))
        if not modules:  # a routing file without progress buffers names no modules: the config's targets find them
            names = apply_(model, config)
            _load_routing(model, saved, str(routing_path))
            return names
        record = {"version": RECORD_VERSION, "groups": [{"config": config.to_dict(), "modules": modules}]}
    names = apply_record(model, record)
    _load_routing(model, saved, str(routing_path))
    return names


def _load_routing(model: nn.Module, saved: dict[str, Tensor], source: str) -> None:
    """Load the routing tensors ``saved`` into the freshly wrapped ``model``; on any mismatch unwrap and raise."""
    from condcomp.api import remove_

    try:
        rename = _name_map(model, {_module_of(k) for k in saved})
        saved = {rename(_module_of(k)) + k[len(_module_of(k)):]: t for k, t in saved.items()}
        expected = routing_state(model)
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        bad = sorted(k for k in set(saved) & set(expected) if saved[k].shape != expected[k].shape)
        if missing or unexpected or bad:
            raise ValueError(f"{source} does not match the wrapped model: missing {missing}, "
                             f"unexpected {unexpected}, shape mismatch {bad}")
        model.load_state_dict(saved, strict=False)
    except BaseException:
        remove_(model)
        raise


def _verify_routing_file(directory: Path) -> None:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        warnings.warn(f"{directory} has no {MANIFEST_FILE} (its writer kept no digests): the routing file's integrity "
                      "cannot be checked; save it again to add one", stacklevel=3)
        return
    try:
        manifest = read_json(path, "condcomp's routing manifest", _SAVE_AGAIN)
    except FileError as e:
        raise CheckpointError(str(e)) from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: not a condcomp routing manifest")
    verify_digest(directory / ROUTING_FILE, files.get(ROUTING_FILE), MANIFEST_FILE)


def apply_record(model: nn.Module, record: Any) -> list[str]:
    """Wrap an unwrapped ``model`` as ``record`` says (each group's exact modules with its config)."""
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION or not isinstance(
            record.get("groups"), list):
        raise ValueError(f"not a condcomp routing record of version {RECORD_VERSION}: {str(record)[:200]}")
    names: list[str] = []
    rename = _name_map(model, {n for group in record["groups"] for n in group["modules"]})
    try:
        for group in record["groups"]:
            config = CondCompConfig.from_dict(group["config"])
            modules = [rename(n) for n in group["modules"]]
            exact = CondCompConfig.from_dict({**group["config"], "exclude_modules": None, "target_modules": [
                "re:" + re.escape(n) for n in modules]})
            wrapped = apply_(model, exact)
            if sorted(wrapped) != sorted(modules):
                raise ValueError(f"the record names modules {modules}, the model wrapped {wrapped}")
            routed = routed_modules(model)
            for n in wrapped:
                routed[n].condcomp_config = config  # what the user wrapped with, for the next save
            names += wrapped
    except BaseException:
        if routed_modules(model):
            remove_(model)
        raise
    store_record_in_config(model)
    return names


def _module_of(key: str) -> str:
    """The wrapped module a routing tensor's key belongs to (the part before its first ``condcomp_`` marker)."""
    return min((key[: i - 1] for m in _MARKERS if (i := key.find(m)) > 0), key=len, default=key)


def _name_map(model: nn.Module, saved_modules: set[str]) -> Any:
    """Saved module name -> this model's: as saved, or with ``base_model_prefix.`` removed (a base model loaded
    from a folder saved with a head) or added (the reverse), whichever names modules this model has."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    modules = {n for n, _ in model.named_modules()}
    candidates = [lambda n: n]
    if prefix:
        candidates += [lambda n: n[len(prefix) + 1:] if n.startswith(prefix + ".") else n,
                       lambda n: f"{prefix}.{n}"]
    for rename in candidates:
        if all(rename(n) in modules for n in saved_modules):
            return rename
    return candidates[0]


def save_pretrained(model: Any, directory: str | os.PathLike[str], config: CondCompConfig | None = None,
                    **kwargs: Any) -> Path:
    """``model.save_pretrained(directory)`` without the routing tensors, plus :func:`save_condcomp`.

    >>> save_pretrained(model, "out/")  # doctest: +SKIP  (the config apply_ used is saved beside the weights)
    >>> model2 = from_pretrained(BertModel, "out/")  # doctest: +SKIP
    """
    state = {k: v for k, v in model.state_dict().items() if not _is_routing(k)}
    model.save_pretrained(str(directory), state_dict=state, **kwargs)
    return save_condcomp(model, directory, config)


def from_pretrained(model_cls: Any, directory: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Load a wrapped model saved by its own ``save_pretrained`` (or Trainer, or :func:`save_pretrained` here).

    ``model_cls.from_pretrained(directory, **kwargs)`` loads the dense weights; the routing is then rebuilt from
    the record in ``config.json`` (``model.config.condcomp``, written by ``apply_``) and loaded from the same
    weight files, or from ``condcomp_config.json`` + ``condcomp_routing.safetensors`` where those exist.

    >>> model.save_pretrained("out/")  # doctest: +SKIP  (a wrapped model: routing, config and progress included)
    >>> model2 = from_pretrained(BertModel, "out/")  # doctest: +SKIP
    """
    directory = Path(directory)
    # The routing tensors are expected in the weight files: keep transformers from reporting them as unexpected.
    ignored = getattr(model_cls, "_keys_to_ignore_on_load_unexpected", None)
    patched = ignored is not None or hasattr(model_cls, "_keys_to_ignore_on_load_unexpected")
    if patched:
        model_cls._keys_to_ignore_on_load_unexpected = [*(ignored or []), r".*condcomp_(policy|router|progress).*"]
    try:
        model = model_cls.from_pretrained(str(directory), **kwargs)
    finally:
        if patched:
            model_cls._keys_to_ignore_on_load_unexpected = ignored
    if (directory / CONFIG_FILE).is_file():
        load_condcomp(model, directory)
        return model
    record = getattr(model.config, "condcomp", None)
    if record is None:
        raise FileNotFoundError(f"{directory} holds no condcomp routing: no {CONFIG_FILE} and no 'condcomp' entry in "
                                "config.json (was the model wrapped with condcomp.apply_ before save_pretrained?)")
    apply_record(model, record)
    _load_routing(model, _routing_from_weight_files(directory), str(directory))
    return model


def _routing_from_weight_files(directory: Path) -> dict[str, Tensor]:
    """The routing tensors among the weights ``save_pretrained`` wrote (one file or shards)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = field(read_json_object(index, "transformers' weight index", _SAVE_AGAIN), "weight_map", index,
                           _SAVE_AGAIN)
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: field 'weight_map' must map names to file names, found "
                                  f"{describe(weight_map)}; {_SAVE_AGAIN}")
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{directory}: no model.safetensors (or index) to read the routing tensors from")
    out: dict[str, Tensor] = {}
    for name in files:
        try:
            with safe_open(str(directory / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                    if _is_routing(key):
                        out[key] = f.get_tensor(key)
        except Exception as e:  # safetensors' own error type for a truncated or foreign file names no path
            raise CheckpointError(f"{directory / name}: unreadable safetensors file ({e}); {_SAVE_AGAIN}") from e
    return out


def saved_config(directory: str | os.PathLike[str]) -> CondCompConfig:
    """The :class:`~condcomp.CondCompConfig` stored in ``directory``."""
    path = Path(directory) / CONFIG_FILE
    return _config_from(path, read_json_object(path, "condcomp's routing config", _SAVE_AGAIN))


def _config_from(path: Path, stored: dict[str, Any]) -> CondCompConfig:
    """The config a file holds; one it cannot build is named with the file (not a bare TypeError)."""
    try:
        return CondCompConfig.from_dict(stored)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path} does not hold a condcomp config this version can build ({e}); "
                              f"{_SAVE_AGAIN}") from e
