"""A user's own code named on a command line: ``module:attribute`` (a module importable from the current folder
or ``PYTHONPATH``) or ``path/to/file.py:attribute`` (a file, imported once per process).

``ablate --router-arms my_routers:NormRouter`` and ``bench kv --variants my_kv.py:FirstTokensKV`` both read their
spec with :func:`load_attribute`; a bad spec is a ``ValueError`` saying what to write instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def is_spec(value: Any) -> bool:
    """Whether ``value`` is a ``module:attribute`` or ``file.py:attribute`` spec (a registry key has no colon)."""
    return isinstance(value, str) and ":" in value


def load_attribute(value: str, what: str, example: str) -> Any:
    """The object ``value`` names; ``what`` (e.g. ``"router"``) and ``example`` (e.g. ``"my_routers:MyRouter"``)
    word the errors."""
    source, _, attribute = value.rpartition(":")
    if not source or not attribute or not attribute.isidentifier():
        raise ValueError(f"{what} {value!r}: write module:Name or path/to/file.py:Name, e.g. {example}")
    module = _import_file(source, value, what) if source.endswith(".py") else _import_module(source, value, what)
    obj = getattr(module, attribute, None)
    if obj is None:
        raise ValueError(f"{what} {value!r}: {source} has no attribute {attribute!r} (it has: "
                         f"{', '.join(n for n in sorted(vars(module)) if not n.startswith('_'))})")
    return obj


def _import_module(name: str, value: str, what: str) -> ModuleType:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module beside the user is importable
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(f"{what} {value!r}: cannot import {name} ({err}); run from the folder that holds "
                         f"{name.replace('.', '/')}.py, add its folder to PYTHONPATH, or name the file "
                         f"(path/to/{name.rsplit('.', 1)[-1]}.py:Name)") from None


def _import_file(path: str, value: str, what: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"{what} {value!r}: no file {path} (from {os.getcwd()})")
    # one module per file and process: importing it again would register its components twice
    name = f"condcomp_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what} {value!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
