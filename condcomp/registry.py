"""Registries of policies, routers, executors and KV policies, keyed by lowercase strings and filled by decorators."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from condcomp.options import check_options, checked_construction, declared_options, owner_name

T = TypeVar("T")

# Layer facts a component constructor may ask for by naming them as keyword parameters.
LAYER_FACTS = ("d_model", "num_heads", "num_kv_heads", "head_dim")


class Registry(Generic[T]):
    """A name -> component-class table with clear errors for unknown keys and bad kwargs.

    A class that declares numeric options (``options = (condcomp.options.count("budget"), ...)``, see
    :mod:`condcomp.options`) has them checked when a config names it and whenever it is built."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._entries: dict[str, Any] = {}

    def register(self, name: str, override: bool = False) -> Callable[[T], T]:
        key = name.lower()

        def decorator(obj: T) -> T:
            existing = self._entries.get(key)
            if existing is not None and not override and not _same_definition(existing, obj):
                raise ValueError(f"{self.role} {key!r} is already registered ({_qualname(existing)}); choose another "
                                 f"name, or pass override=True to replace it")
            self._entries[key] = obj
            try:
                obj.registry_key = key  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            if isinstance(obj, type) and declared_options(obj):
                checked_construction(obj, self.role)  # its declared options are checked whenever it is built
            return obj

        return decorator

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> tuple[tuple[str, Any], ...]:
        """Every ``(name, registered object)``: what a cache derived from the registry is keyed on (a name
        registered again, ``override=True``, changes it)."""
        return tuple(self._entries.items())

    def get(self, name: str) -> Any:
        key = name.lower()
        if key not in self._entries:
            plural = f"{self.role[:-1]}ies" if self.role.endswith("policy") else f"{self.role}s"
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
        check_options(owner_name(cls, self.role), declared_options(cls), kwargs)
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


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _same_definition(a: Any, b: Any) -> bool:
    # The same object, or the same definition run again (a reloaded module, a re-run notebook cell).
    return a is b or _qualname(a) == _qualname(b)


POLICIES: Registry[Any] = Registry("policy")
ROUTERS: Registry[Any] = Registry("router")
EXECUTORS: Registry[Any] = Registry("executor")
KV_POLICIES: Registry[Any] = Registry("kv policy")


def register_policy(name: str, *, override: bool = False) -> Callable[[T], T]:
    """Class decorator: make a budget policy available as ``CondCompConfig(policy=name)``.

    A name already taken is an error unless ``override=True`` (then the new class serves every later ``apply_``).

    >>> import condcomp
    >>> "fixed" in condcomp.list_policies()
    True
    """
    return POLICIES.register(name, override)


def register_router(name: str, *, override: bool = False) -> Callable[[T], T]:
    """Class decorator: make a router available as ``CondCompConfig(router=name)`` (``override=True`` to replace
    a registered one)."""
    return ROUTERS.register(name, override)


def register_executor(name: str, *, override: bool = False) -> Callable[[T], T]:
    """Class decorator: make an executor available as ``CondCompConfig(executor=name)`` (``override=True`` to
    replace a registered one; it takes effect at the next call)."""
    return EXECUTORS.register(name, override)


def register_kv_policy(name: str, *, override: bool = False) -> Callable[[T], T]:
    """Class decorator: make a KV policy (what a request's key/value group keeps in its cache, see
    :mod:`condcomp.kv`) available as ``CondCompConfig(kv=name)`` (``override=True`` to replace a registered one).

    >>> import condcomp
    >>> "window" in condcomp.list_kv_policies()
    True
    """
    return KV_POLICIES.register(name, override)


def list_policies() -> list[str]:
    """Registered budget policy keys."""
    return POLICIES.names()


def list_routers() -> list[str]:
    """Registered router keys."""
    return ROUTERS.names()


def list_executors() -> list[str]:
    """Registered executor keys (``"auto"`` is accepted too and picks among them)."""
    return EXECUTORS.names()


def list_kv_policies() -> list[str]:
    """Registered KV policy keys (``CondCompConfig(kv=...)``)."""
    return KV_POLICIES.names()


def registered_name(component: Any, registry: Registry[Any]) -> str:
    """The registry key of ``component`` (a registered name, or a class registered under some name)."""
    if isinstance(component, str):
        registry.get(component)  # an unknown name: KeyError listing the registered ones
        return component.lower()
    key = vars(component).get("registry_key") if isinstance(component, type) else None
    if key is None or registry.get(key) is not component:
        raise TypeError(f"{component!r} is not a registered {registry.role}; decorate its class with "
                        f"condcomp.register_{registry.role.replace(' ', '_')}(\"name\") and pass the class or the "
                        "name")
    return str(key)
