"""A router or policy of the user's as a run's component or a study's arm: a registered name, or a
``module:attribute`` spec that imports the module (from the current folder or ``PYTHONPATH``) and registers the
class.

``--router my_routers:NormRouter`` imports ``my_routers`` and registers ``NormRouter`` under the key its
``@condcomp.register_router`` decorator gave it (or, undecorated, its class name in lower case). The spec, not
the key, is what a run records (``method_options``), so ``condcomp eval`` and a resumed study import it again.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from condcomp.registry import POLICIES, ROUTERS, Registry

ROLES: dict[str, Registry[Any]] = {"router": ROUTERS, "policy": POLICIES}


def is_spec(value: Any) -> bool:
    """Whether ``value`` is a ``module:attribute`` spec (a registry key has no colon)."""
    return isinstance(value, str) and ":" in value


def resolve(role: str, value: str) -> str:
    """The registry key of ``value``: a registered name as it is, a ``module:attribute`` spec imported and
    registered. Anything else: a ``ValueError`` saying what to pass."""
    registry = ROLES[role]
    if not is_spec(value):
        if value.lower() not in registry.names():
            raise ValueError(f"{role} {value!r}: no {role} of that name (registered: "
                             f"{', '.join(registry.names())}); pass a registered name or module:Class, e.g. "
                             f"my_{role}s:My{role.title()}")
        return value.lower()
    module_name, _, attribute = value.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{role} {value!r}: write module:Class, e.g. my_{role}s:My{role.title()}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a module beside the user is importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{role} {value!r}: cannot import {module_name} ({err}); run from the folder that "
                         f"holds {module_name.replace('.', '/')}.py, or add its folder to PYTHONPATH") from None
    obj = getattr(module, attribute, None)
    if not isinstance(obj, type):
        found = "nothing" if obj is None else type(obj).__name__
        raise ValueError(f"{role} {value!r}: {module_name}.{attribute} is {found}, not a class; name the "
                         f"{role}'s class")
    key = vars(obj).get("registry_key")
    if key is not None and key in registry.names() and registry.get(key) is obj:
        return str(key)  # registered by its decorator when the module was imported
    key = attribute.lower()
    registry.register(key)(obj)  # a key taken by another class: a ValueError naming both
    return key


def arm_name(role: str, value: str) -> str:
    """The study arm of a user's component: ``router_<key>`` / ``policy_<key>``."""
    return f"{role}_{resolve(role, value)}"
