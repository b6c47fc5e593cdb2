"""Resuming a run exactly: what every resumable command saves besides its weights, and the checks on resuming.

A run resumed from a checkpoint must end as the uninterrupted run would, bit for bit on CPU. Weights and optimiser
state are not enough: routers that train with noise, dropout, shuffled batches and sampled timesteps draw from
random-number generators, so a checkpoint also holds

- every generator the run draws from (:func:`capture_rng` / :func:`restore_rng`): torch's CPU generator, CUDA's
  when CUDA is initialised (it is never initialised here), Python's ``random``, NumPy's global generator when
  NumPy is loaded, and any ``torch.Generator`` the loop owns (named by the caller);
- the settings the rest of the run depends on, compared on resuming (:func:`check_settings`): a checkpoint made
  with other settings is refused, naming each setting that differs, instead of being continued into a run that
  is neither;
- what it belongs to (:func:`model_identity`: the model's name, hashes of its config and of its weights' names
  and shapes, the command): a checkpoint of another model is refused the same way, even when the shapes match,
  and its tensors are checked against this run's before any ``load_state_dict`` (never torch's bare size error).

:class:`ResumeFile` is the single-file checkpoint of the loops that keep one (``calibrate-kv``, ``tune-llm``,
``dit``): it is written to a temporary file and renamed into place, so a run stopped mid-save keeps the previous
checkpoint, and read with ``weights_only=True`` (no pickle code runs). The classifier's checkpoints are
:mod:`condcomp.checkpoint` directories; their ``train_state`` carries :func:`capture_rng`'s state the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from condcomp.files import FileError, read_torch

FORMAT = "condcomp-resume/1"


class ResumeError(FileError):
    """A checkpoint cannot be resumed by this run (other settings, another model, another format); the message
    names the file and says what to do."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_identity(model: nn.Module, name: str | None = None, values: bool = False) -> dict[str, Any]:
    """What a checkpoint of a run on ``model`` belongs to: its name (``name``, else the config's ``name_or_path``,
    else the class), its layer and parameter counts, a hash of its config and one of its tensors' names, shapes
    and dtypes; ``values``: also a hash of the first values of every tensor (for a model the run does not train,
    so that two models of the same shapes and name are told apart).

    >>> a, b = model_identity(nn.Linear(4, 2)), model_identity(nn.Linear(4, 3))
    >>> a["model"], a["parameters"], a["shapes"] != b["shapes"]
    ('Linear', 10, True)
    """
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    config = {k: v for k, v in (to_dict() if callable(to_dict) else {}).items()
              if not k.startswith("_") and k != "transformers_version"}  # where it was loaded from is the name
    name = name or str(getattr(cfg, "name_or_path", "") or "") or type(model).__name__
    tensors = list(model.state_dict(keep_vars=False).items())
    out: dict[str, Any] = {"model": name, "layers": config.get("num_hidden_layers"),
                           "parameters": sum(p.numel() for p in model.parameters()),
                           "config": _digest(json.dumps(config, sort_keys=True, default=str)),
                           "shapes": _digest(";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in tensors))}
    if values:
        with torch.no_grad():
            first = [t.detach().reshape(-1)[:8].double().cpu() for _, t in tensors if t.is_floating_point()]
        out["weights"] = _digest(repr(torch.cat(first).tolist())) if first else "none"  # no numpy needed
    return out


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The state of every generator a run may draw from: tensors and JSON values only (saved without pickle).

    >>> state = capture_rng()
    >>> a = torch.rand(2); r = random.random()
    >>> restore_rng(state)
    >>> torch.equal(torch.rand(2), a) and random.random() == r
    True
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": {"version": version, "internal": list(internal), "gauss": gauss}}
    if torch.cuda.is_initialized():  # asking otherwise would initialise CUDA
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # a run that never imported NumPy cannot have drawn from it
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state(legacy=True)
        state["numpy"] = {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    state["generators"] = {name: g.get_state() for name, g in (generators or {}).items()}
    return state


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put back :func:`capture_rng`'s ``state``; ``generators``: the loop's own, by the names they were saved under.
    Call it last before the loop continues: anything drawn after it shifts the streams."""
    mine = dict(generators or {})
    saved = state.get("generators", {})
    if set(saved) != set(mine):
        raise ResumeError(f"the checkpoint holds the generators {sorted(saved)}, this run has {sorted(mine)}")
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["internal"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))  # applied lazily: does not initialise CUDA itself
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    for name, g in mine.items():
        g.set_state(saved[name])


def _plain(value: Any) -> Any:
    """``value`` as JSON would give it back (tuples as lists), so settings compare alike however they were stored."""
    return json.loads(json.dumps(value))


def setting_differences(saved: Mapping[str, Any], now: Mapping[str, Any], may_differ: Iterable[str] = ()) -> list[str]:
    """``"lr 0.05 there, 0.02 now"`` for each setting that differs (a setting absent on one side differs too)."""
    skip, missing = set(may_differ), "(unset)"
    a, b = _plain(dict(saved)), _plain(dict(now))
    return [f"{k} {a.get(k, missing)!r} there, {b.get(k, missing)!r} now" for k in sorted(set(a) | set(b))
            if k not in skip and a.get(k, missing) != b.get(k, missing)]


def check_settings(source: Path, saved: Mapping[str, Any], now: Mapping[str, Any],
                   may_differ: Iterable[str] = ()) -> None:
    """Refuse to resume ``source`` when its settings differ from this run's, naming every difference."""
    diff = setting_differences(saved, now, may_differ)
    if diff:
        raise ResumeError(f"{source} was written by a run with other settings ({'; '.join(diff)}): resuming it "
                          "would continue another run. Run with its settings to resume it, or delete it (or write "
                          "elsewhere) to start over")


def check_owner(source: Path, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Refuse to resume ``source`` when it belongs to another model or command (:func:`model_identity`)."""
    diff = setting_differences(saved, now)
    if diff:
        raise ResumeError(f"{source} belongs to another model or command ({'; '.join(diff)}): resuming it would "
                          f"continue that run with this model. Delete {source} (or write elsewhere) to start over")


class ResumeFile:
    """A one-file checkpoint at ``path`` for a run with ``settings`` (JSON values); ``may_differ``: settings a
    resumed run may change (e.g. the number of steps of a run without a schedule over it); ``owner``: what the run
    belongs to (the command and :func:`model_identity`), saved and compared like the settings."""

    def __init__(self, path: Path, settings: Mapping[str, Any], may_differ: Iterable[str] = (),
                 owner: Mapping[str, Any] | None = None) -> None:
        self.path, self.settings, self.may_differ = Path(path), dict(settings), tuple(may_differ)
        self.owner = dict(owner) if owner is not None else None

    def load(self) -> dict[str, Any] | None:
        """The saved state (``rng`` among it), or None when there is no checkpoint; refused with each difference
        named when it was written for another model or command, or by a run with other settings."""
        state = self.read()
        if state is not None:
            self.check(state)
        return state

    def check(self, state: Mapping[str, Any]) -> None:
        """Refuse ``state`` (as :meth:`read` gives it) when its owner or settings are not this run's."""
        if self.owner is not None:
            if "owner" not in state:
                raise ResumeError(f"{self.path} was written by an older condcomp that did not record the model it "
                                  f"belongs to, so resuming it could continue another model's run: delete {self.path} "
                                  "to start over")
            check_owner(self.path, state["owner"], self.owner)
        check_settings(self.path, state.get("settings", {}), self.settings, self.may_differ)

    def check_tensors(self, name: str, saved: Any, expected: Mapping[str, Any]) -> None:
        """Refuse a saved state dict ``name`` whose keys or shapes are not ``expected``'s, before loading it."""
        from condcomp.files import check_state_shapes, tensor_dict

        hint = f"delete {self.path} (or write elsewhere) to start over"
        try:
            state = tensor_dict(saved, self.path, name, hint)
        except FileError as err:
            raise ResumeError(str(err)) from None
        check_state_shapes(self.path, name, state, expected, hint, ResumeError)

    def read(self) -> dict[str, Any] | None:
        """The saved state as written, or None when there is no checkpoint; its settings not yet compared."""
        if not self.path.is_file():
            return None
        try:  # truncated, not a torch file, or holding objects only pickle could rebuild
            state = read_torch(self.path, "a checkpoint this condcomp can resume", "delete it to start over")
        except FileError as err:
            raise ResumeError(str(err)) from err.__cause__
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ResumeError(f"{self.path} was written by another condcomp version (format {found!r}, this one "
                              f"resumes {FORMAT!r}) and lacks what an exact resume needs; delete it to start over")
        return state

    def save(self, state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
        """Write ``state`` (tensors, state dicts, JSON values) with the settings and every generator's state:
        to a temporary file first, then renamed over the checkpoint (a stop mid-save keeps the previous one)."""
        payload = {**state, "format": FORMAT, "settings": self.settings, "rng": capture_rng(generators)}
        if self.owner is not None:
            payload["owner"] = self.owner
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def remove(self) -> None:
        """The run finished (its result is written): the checkpoint has served."""
        self.path.unlink(missing_ok=True)
        self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)

