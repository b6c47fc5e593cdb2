"""Registries of policies, routers and executors, keyed by lowercase strings and filled by decorators."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Layer facts a component constructor may ask for by naming them as keyword parameters.
LAYER_FACTS = ("d_model", "num_heads", "num_kv_heads", "head_dim")


class Registry(Generic[T]):
    """A name -> component-class table with clear errors for unknown keys and bad kwargs."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._entries: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[T], T]:
        key = name.lower()

        def decorator(obj: T) -> T:
            self._entries[key] = obj
            try:
                obj.registry_key = key  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            return obj

        return decorator

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Any:
        key = name.lower()
        if key not in self._entries:
            plural = "policies" if self.role == "policy" else f"{self.role}s"
            raise KeyError(f"unknown {self.role} {name!r}; registered {plural}: {', '.join(self.names())}")
        return self._entries[key]

    def check_kwargs(self, name: str, kwargs: dict[str, Any]) -> None:
        """Raise a clear error if ``kwargs`` cannot be passed to the component (before any model exists)."""
        cls = self.get(name)
        params = inspect.signature(cls).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key in kwargs:
            if key in LAYER_FACTS:
                raise TypeError(f"{self.role} {name!r}: {key!r} is taken from the wrapped layer, not the config")
            if not takes_any and key not in params:
                valid = [p for p in params if p not in LAYER_FACTS and p != "self"]
                raise TypeError(f"{self.role} {name!r} has no option {key!r}; its options are: {valid}")
        validate = getattr(cls, "validate_options", None)
        if callable(validate):
            validate(**kwargs)

    def build(self, name: str, kwargs: dict[str, Any], facts: dict[str, int]) -> Any:
        """Instantiate ``name`` with ``kwargs`` plus the layer facts its constructor names."""
        cls = self.get(name)
        self.check_kwargs(name, kwargs)
        params = inspect.signature(cls).parameters
        wanted = {k: v for k, v in facts.items() if k in params}
        return cls(**wanted, **kwargs)


POLICIES: Registry[Any] = Registry("policy")
ROUTERS: Registry[Any] = Registry("router")
EXECUTORS: Registry[Any] = Registry("executor")


def register_policy(name: str) -> Callable[[T], T]:
    """Class decorator: make a budget policy available as ``CondCompConfig(policy=name)``.

    >>> import condcomp
    >>> "fixed" in condcomp.list_policies()
    True
    """
    return POLICIES.register(name)


def register_router(name: str) -> Callable[[T], T]:
    """Class decorator: make a router available as ``CondCompConfig(router=name)``."""
    return ROUTERS.register(name)


def register_executor(name: str) -> Callable[[T], T]:
    """Class decorator: make an executor available as ``CondCompConfig(executor=name)``."""
    return EXECUTORS.register(name)


def list_policies() -> list[str]:
    """Registered budget policy keys."""
    return POLICIES.names()


def list_routers() -> list[str]:
    """Registered router keys."""
    return ROUTERS.names()


def list_executors() -> list[str]:
    """Registered executor keys (``"auto"`` is accepted too and picks among them)."""
    return EXECUTORS.names()
