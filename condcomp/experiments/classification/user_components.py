"""A router or policy of the user's as a run's component or a study's arm: a registered name, or a
``module:attribute`` spec that imports the module (from the current folder or ``PYTHONPATH``; or
``path/to/file.py:attribute``, :mod:`condcomp.user_spec`) and registers the class.

``--router my_routers:NormRouter`` imports ``my_routers`` and registers ``NormRouter`` under the key its
``@condcomp.register_router`` decorator gave it (or, undecorated, its class name in lower case). The spec, not
the key, is what a run records (``method_options``), so ``condcomp eval`` and a resumed study import it again.
"""

from __future__ import annotations

from typing import Any

from condcomp.registry import POLICIES, ROUTERS, Registry
from condcomp.user_spec import is_spec, load_attribute

ROLES: dict[str, Registry[Any]] = {"router": ROUTERS, "policy": POLICIES}


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
    obj = load_attribute(value, role, f"my_{role}s:My{role.title()}")
    attribute = value.rpartition(":")[2]
    if not isinstance(obj, type):
        raise ValueError(f"{role} {value!r}: {attribute} is a {type(obj).__name__}, not a class; name the "
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
