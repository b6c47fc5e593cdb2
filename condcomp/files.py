"""Reading the files condcomp is given: one contract for gates, rankings, router files, checkpoints and text.

Every error of a loader built on these functions is a :class:`FileError` (a ``ValueError``; a missing file stays a
``FileNotFoundError``) whose message names the path, what was expected and what was found, and says what to do:

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "gates.json"
>>> _ = p.write_text("[1, 2]")
>>> try:
...     read_json_object(p, "a KV gates file", "write it with condcomp calibrate-kv")
... except FileError as err:
...     print(str(err).replace(str(p), "gates.json"))
gates.json is not a KV gates file: expected a JSON object, found a JSON list; write it with condcomp calibrate-kv

The checks of a record's fields (:func:`field`, :func:`int_field`, :func:`float_matrix`) say the same about one
field: missing, null, a string where numbers belong, ragged rows, a wrong shape, non-finite values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


class FileError(ValueError):
    """A file condcomp reads cannot be used; the message names the path, what was expected and what was found."""


def describe(value: Any) -> str:
    """What a JSON (or torch) value is, in words: ``"a JSON list"``, ``"null"``, ``"the string 'x'"``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, Mapping):
        return f"a JSON object with keys {sorted(map(str, value))[:6]}"
    if isinstance(value, (list, tuple)):
        return "a JSON list"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _check_exists(path: Path, what: str, hint: str) -> None:
    if path.is_dir():
        raise FileError(f"{path} is not {what}: expected a file, found a folder; {hint}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected {what}); {hint}")


def read_text(path: str | Path, what: str, hint: str) -> str:
    """The UTF-8 text of ``path``; a binary or other-encoding file is named with the first byte that is not UTF-8."""
    path = Path(path)
    _check_exists(path, what, hint)
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        kind = "a binary file" if b"\0" in raw[:4096] else "text in another encoding than UTF-8 (latin-1?)"
        raise FileError(f"{path} is not {what}: expected UTF-8 text, found {kind} (byte "
                        f"0x{raw[err.start]:02x} at offset {err.start} is not UTF-8); {hint}") from None


def read_json(path: str | Path, what: str, hint: str) -> Any:
    """The JSON value in ``path``; a truncated or non-JSON file is named with the line and column that failed."""
    path = Path(path)
    text = read_text(path, what, hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        found = "an empty file" if not text.strip() else f"invalid JSON ({err.msg} at line {err.lineno} column " \
                f"{err.colno}{': truncated?' if err.pos >= len(text.rstrip()) else ''})"
        raise FileError(f"{path} is not {what}: expected JSON, found {found}; {hint}") from None


def read_json_object(path: str | Path, what: str, hint: str) -> dict[str, Any]:
    """The JSON object in ``path``: a list, a number or null there is a :class:`FileError` naming it."""
    value = read_json(path, what, hint)
    if not isinstance(value, dict):
        raise FileError(f"{path} is not {what}: expected a JSON object, found {describe(value)}; {hint}")
    return value


def read_torch(path: str | Path, what: str, hint: str) -> Any:
    """What ``torch.save`` wrote to ``path``, read with ``weights_only=True`` (no pickle code runs) onto the CPU."""
    path = Path(path)
    _check_exists(path, what, hint)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, not a torch file, or objects only pickle could rebuild
        with open(path, "rb") as f:
            head = f.read(8)
        detail = (str(err).strip().splitlines() or ["no detail"])[-1][:200]
        if not head:
            found = "an empty file"
        elif not head.startswith(b"PK") and head[:1] != b"\x80":  # torch.save writes a zip (or a legacy pickle)
            found = f"another kind of file (it starts with {head!r})"
        elif "weights only" in str(err).lower() or "weights_only" in str(err):
            found = f"objects only pickle could rebuild, which condcomp never runs ({detail})"
        else:
            found = f"a truncated or damaged torch file ({type(err).__name__}: {detail})"
        raise FileError(f"{path} is not {what}: expected a torch file, found {found}; {hint}") from err


def read_torch_dict(path: str | Path, what: str, hint: str) -> dict[str, Any]:
    """:func:`read_torch`, refused unless the file holds a dict."""
    value = read_torch(path, what, hint)
    if not isinstance(value, dict):
        raise FileError(f"{path} is not {what}: expected a dict, found {describe(value)}; {hint}")
    return value


def field(record: Mapping[str, Any], name: str, path: str | Path, hint: str) -> Any:
    """``record[name]``; a missing key or null is a :class:`FileError` naming the field and the file."""
    if name not in record:
        raise FileError(f"{path}: field {name!r} is missing (found keys {sorted(map(str, record))[:8]}); {hint}")
    value = record[name]
    if value is None:
        raise FileError(f"{path}: field {name!r} is null; {hint}")
    return value


def int_field(record: Mapping[str, Any], name: str, path: str | Path, hint: str, low: int = 0,
              high: int | None = None) -> int:
    """An integer field in ``[low, high]``: ``"3"``, ``3.7`` and ``true`` are refused (``int()`` would pass them)."""
    value = field(record, name, path, hint)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise FileError(f"{path}: {name} must be an int {bounds}, got {value!r}; {hint}")
    return value


def float_matrix(value: Any, path: str | Path, name: str, hint: str,
                 shape: tuple[int, int] | None = None) -> Tensor:
    """A list of equal-length lists of finite numbers as a float64 tensor ``(rows, cols)``, checked against
    ``shape``; strings, booleans, nulls, ragged rows and NaN or infinite values are named with their place."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise FileError(f"{path}: field {name!r} must be a list of lists of numbers, found {describe(value)}"
                        f"{'' if not isinstance(value, list) else ' with a non-list row'}; {hint}")
    widths = sorted({len(row) for row in value})
    if len(widths) > 1:
        raise FileError(f"{path}: field {name!r} is ragged (rows of {widths} numbers); {hint}")
    for i, row in enumerate(value):
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise FileError(f"{path}: {name}[{i}][{j}] must be a number, found {describe(v)}; {hint}")
            if not math.isfinite(v):
                raise FileError(f"{path}: {name}[{i}][{j}] is {v!r}, not a finite number; {hint}")
    found = (len(value), widths[0] if widths else 0)
    if shape is not None and found != tuple(shape):
        raise FileError(f"{path}: field {name!r} has shape {found}, this model needs {tuple(shape)}; {hint}")
    return torch.tensor(value, dtype=torch.float64).reshape(found)


def tensor_dict(value: Any, path: str | Path, name: str, hint: str) -> dict[str, Tensor]:
    """A dict of string -> tensor (a state dict as a file holds it)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(t, Tensor)
                                                 for k, t in value.items()):
        raise FileError(f"{path}: {name} must be a dict of tensors, found {describe(value)}; {hint}")
    return dict(value)


def check_state_shapes(path: str | Path, name: str, saved: Mapping[str, Tensor], expected: Mapping[str, Any],
                       hint: str, error: type[FileError] = FileError) -> None:
    """Refuse a state dict whose keys or shapes are not ``expected``'s (before ``load_state_dict`` could fail with
    torch's bare size-mismatch error), naming each difference."""
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    shapes = [f"{k} {tuple(saved[k].shape)} there, {tuple(expected[k].shape)} now" for k in sorted(set(saved) &
              set(expected)) if isinstance(expected[k], Tensor) and tuple(saved[k].shape) != tuple(expected[k].shape)]
    if missing or extra or shapes:
        parts = [f"{what} {keys[:6]}" for what, keys in (("missing", missing), ("unexpected", extra)) if keys]
        parts += [f"shapes differ: {'; '.join(shapes[:6])}"] if shapes else []
        raise error(f"{path}: {name} does not fit this run ({', '.join(parts)}); {hint}")


__all__ = ["FileError", "check_state_shapes", "describe", "field", "float_matrix", "int_field", "read_json",
           "read_json_object", "read_text", "read_torch", "read_torch_dict", "tensor_dict"]
