"""Adapters for third-party attention modules. ``hf`` and ``timm`` load lazily, only for models that use them.

Every submodule is also reachable as an attribute after ``import condcomp`` alone
(``condcomp.integrations.hf.CondCompCallback``, ``condcomp.integrations.hf_checkpoint.from_pretrained``, ...):
the first access imports it, and with it its library (transformers, timm), so ``import condcomp`` stays light.
"""

import importlib
from types import ModuleType

from condcomp.integrations import torch_mha  # noqa: F401

# Submodules imported on first attribute access (each imports its third-party library).
_LAZY = ("hf", "timm")
# Attribute names of the public contract (DESIGN.md) that name a module inside the ``hf`` package.
_CONTRACT_NAMES = {"hf_checkpoint": "hf.checkpoint"}


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY or name in _CONTRACT_NAMES:
        return importlib.import_module(f"{__name__}.{_CONTRACT_NAMES.get(name, name)}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_CONTRACT_NAMES})
