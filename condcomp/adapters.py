"""How a concrete attention module maps onto the canonical layout, and the table of known modules.

An adapter is made per wrapped module. It reads the module's static configuration once, builds per-call
:class:`~condcomp.AttentionWeights` *views* of the parameters, and speaks the module's own call signature.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from torch import nn

from condcomp.types import AttentionWeights, HeadLayout


class AttentionAdapter:
    """Base class of integrations: subclass, set ``module_types``, implement ``weights`` and ``forward``.

    - ``layout``: the module's :class:`~condcomp.HeadLayout`, read in ``__init__``.
    - ``weights(owner)``: views of the parameters, read from ``owner`` (the RoutedAttention, which holds the
      original parameters under their original names) so that parameters swapped later (FSDP, ``to()``) are seen.
    - ``forward(routed, *args, **kwargs)``: the original module's signature and return type; turns the call into
      :class:`~condcomp.AttentionInputs` and returns ``routed.attend(inputs)`` in the original output format.
      ``routed`` is the :class:`~condcomp.RoutedAttention` being called (subclasses annotate it so; this module
      does not import it, since ``condcomp.routed`` builds on this one).
    """

    module_types: tuple[type, ...] = ()
    layout: HeadLayout

    def __init__(self, module: nn.Module) -> None:
        raise NotImplementedError

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return isinstance(module, cls.module_types) if cls.module_types else False

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        """Why this matching module cannot be wrapped (an unsupported option), or None."""
        return None

    @staticmethod
    def attribute_overrides() -> dict[str, Any]:
        """Attributes the wrapper shows instead of the original's (other attributes fall through to it)."""
        return {}

    @staticmethod
    def prepare(model: nn.Module) -> None:
        """Model-wide switches to turn off before wrapping (fused paths that bypass the attention module)."""

    @staticmethod
    def restore(model: nn.Module) -> None:
        """Undo ``prepare`` (called by ``remove_``)."""

    def weights(self, owner: Any) -> AttentionWeights:
        raise NotImplementedError

    def forward(self, routed: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


_ADAPTERS: list[type[AttentionAdapter]] = []

# Integrations loaded only when a model contains a module from that library (import condcomp stays light).
_LAZY_INTEGRATIONS = {
    "transformers": "condcomp.integrations.hf",
    "timm": "condcomp.integrations.timm",
}


def register_adapter(cls: type[AttentionAdapter]) -> type[AttentionAdapter]:
    """Class decorator: make ``apply_`` recognise the adapter's ``module_types``."""
    if cls not in _ADAPTERS:
        _ADAPTERS.append(cls)
    return cls


def load_integrations_for(model: nn.Module) -> None:
    """Import the integration of each third-party library whose modules appear in ``model``."""
    roots = {type(m).__module__.split(".")[0] for m in model.modules()}
    for root, integration in _LAZY_INTEGRATIONS.items():
        if root in roots and root in sys.modules and integration not in sys.modules:
            importlib.import_module(integration)


def find_adapter(module: nn.Module) -> type[AttentionAdapter] | None:
    # Most specific first: later registrations (integrations) may refine earlier, broader ones.
    for cls in reversed(_ADAPTERS):
        if cls.matches(module):
            return cls
    return None


def registered_adapters() -> list[type[AttentionAdapter]]:
    """Every registered adapter class, in registration order."""
    return list(_ADAPTERS)


def supported_classes() -> list[str]:
    return sorted({t.__qualname__ for cls in _ADAPTERS for t in cls.module_types})
