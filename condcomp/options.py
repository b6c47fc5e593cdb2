"""One check for every numeric option: a component declares its options, and one function checks them all.

A registered component (policy, router, executor, KV policy) lists its numeric options as :class:`Option` specs in
a class attribute ``options``; the registry checks them when it is built, before its own ``__init__`` runs
(:func:`checked_construction`), and when a config names it (``Registry.check_kwargs``), so a value that is not a
number, not finite, out of its bounds, or a float or a bool where a whole count is meant, is one error naming the
option, the component and what to pass. The command line's numbers (``condcomp.cli_args.finite_float`` /
``integer``), ``condcomp.budget``'s fraction and settings objects (``CondCompConfig``'s flags, ``GatheredTuning``,
``StreamWindow``, ``TuneSettings``) go through the same check.

>>> spec = count("budget", at_least=0, meaning="prompt tokens kept per group")
>>> try:
...     check_options("snapkv kv policy", (spec,), {"budget": 2**62})
... except ValueError as err:
...     print(err)
snapkv kv policy: budget (prompt tokens kept per group) must be a whole number >= 0 and <= ... (2**40), got ...

Relations between options (``s_min <= s_max``) and bounds that need the layer (``k_min <= num_heads``) stay with the
component, after this check.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal

MAX_COUNT = 1 << 40  # tokens, heads, widths: beyond any model or context, and products with it stay inside int64
MAX_WIDTH = 1 << 20  # a routing MLP's width: far above any model's (d_model <= 2**16), below an allocation that fails
Kind = Literal["count", "real", "flag", "schedule"]


class OptionError(ValueError, TypeError):
    """A bad option value: a ``ValueError`` (out of range, not finite) and a ``TypeError`` (not a number) at once,
    so callers catching either see it."""


def _bound(v: float) -> str:
    if isinstance(v, int) and v >= 1024 and v & (v - 1) == 0:
        return f"{v} (2**{v.bit_length() - 1})"
    return f"{v:g}" if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class Option:
    """One numeric option: ``kind`` ``"count"`` (a whole number; a float or a bool is refused), ``"real"`` (a finite
    number), ``"flag"`` (True or False), ``"schedule"`` (a number or a schedule spec of training progress, finite
    everywhere, :func:`condcomp.schedules.make_schedule`); ``above``/``below`` exclusive and ``at_least``/``at_most``
    inclusive bounds (a count's ``at_most`` defaults to :data:`MAX_COUNT`); ``optional``: None is accepted (it
    stands for a default); ``meaning``: a few words for the error."""

    name: str
    kind: Kind
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    optional: bool = False
    meaning: str = ""

    def __post_init__(self) -> None:
        if self.kind == "count" and self.at_most is None:
            object.__setattr__(self, "at_most", MAX_COUNT)

    def range_words(self) -> str:
        """The bounds in words: ``">= 0 and <= 1099511627776 (2**40)"``."""
        parts = [f"> {_bound(self.above)}" if self.above is not None else "",
                 f">= {_bound(self.at_least)}" if self.at_least is not None else "",
                 f"< {_bound(self.below)}" if self.below is not None else "",
                 f"<= {_bound(self.at_most)}" if self.at_most is not None else ""]
        return " and ".join(p for p in parts if p)

    def wanted(self) -> str:
        """What a good value is, in words."""
        if self.kind == "flag":
            return "True or False"
        noun = {"count": "a whole number", "real": "a finite number",
                "schedule": "a finite number or a schedule spec whose values stay"}[self.kind]
        words = self.range_words()
        text = f"{noun} {words}" if words else noun
        return text + (" (or None)" if self.optional else "")

    def _outside(self, v: float) -> bool:
        lo, lo_in, hi, hi_in = self.above, self.at_least, self.below, self.at_most
        return ((lo is not None and not v > lo) or (lo_in is not None and not v >= lo_in)
                or (hi is not None and not v < hi) or (hi_in is not None and not v <= hi_in))

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not a good value (None: it is)."""
        if value is None:
            return None if self.optional else "None"
        if self.kind == "flag":
            return None if isinstance(value, bool) else "not True or False"
        if isinstance(value, bool):
            return "a bool, not a number"
        if self.kind == "schedule":
            return self._schedule_problem(value)
        if self.kind == "count":
            if not isinstance(value, numbers.Integral):
                return f"a {type(value).__name__}, not an int" if isinstance(value, numbers.Real) else "not a number"
            return "out of range" if self._outside(int(value)) else None
        if not isinstance(value, numbers.Real):
            return "not a number"
        try:
            v = float(value)
        except OverflowError:
            return "not finite in float64"
        if not math.isfinite(v):
            return "not finite"
        return "out of range" if self._outside(v) else None

    def _schedule_problem(self, value: Any) -> str | None:
        from condcomp.schedules import make_schedule

        try:
            values = [make_schedule(value, self.name)(i / 10) for i in range(11)]  # exact for the monotone kinds
        except (ValueError, TypeError, OverflowError) as err:
            return f"not a schedule ({err})"
        if not all(math.isfinite(v) for v in values):
            return "not finite over training"
        return "out of range over training" if any(self._outside(v) for v in values) else None

    def check(self, owner: str, value: Any) -> None:
        """Raise an :class:`OptionError` naming ``owner``, the option and its bounds unless ``value`` is good."""
        why = self.problem(value)
        if why is not None:
            meaning = f" ({self.meaning})" if self.meaning else ""
            raise OptionError(f"{owner}: {self.name}{meaning} must be {self.wanted()}, got {value!r} ({why})")


def count(name: str, at_least: int = 0, at_most: int | None = None, optional: bool = False,
          meaning: str = "") -> Option:
    """A whole-number option in ``[at_least, at_most]`` (``at_most`` default :data:`MAX_COUNT`)."""
    return Option(name, "count", at_least=at_least, at_most=at_most, optional=optional, meaning=meaning)


def real(name: str, *, at_least: float | None = None, above: float | None = None, at_most: float | None = None,
         below: float | None = None, optional: bool = False, meaning: str = "") -> Option:
    """A finite-number option within the bounds given."""
    return Option(name, "real", at_least=at_least, above=above, at_most=at_most, below=below, optional=optional,
                  meaning=meaning)


def flag(name: str, meaning: str = "") -> Option:
    """A True/False option (a string such as ``"false"`` is refused: ``bool("false")`` is True)."""
    return Option(name, "flag", meaning=meaning)


def schedule(name: str, *, at_least: float | None = None, above: float | None = None, meaning: str = "") -> Option:
    """A schedule of training progress (a number or a spec) whose values stay finite and within the bounds."""
    return Option(name, "schedule", at_least=at_least, above=above, meaning=meaning)


def check_options(owner: str, options: Iterable[Option], values: Mapping[str, Any]) -> None:
    """Check each of ``options`` present in ``values``: the one check every numeric option goes through."""
    for option in options:
        if option.name in values:
            option.check(owner, values[option.name])


def declared_options(component: Any) -> tuple[Option, ...]:
    """The options a component class (or instance) declares (``options``), or ``()``."""
    return tuple(getattr(component, "options", ()) or ())


def owner_name(cls: type, role: str | None = None) -> str:
    """How errors name a component: its ``label``, else ``"<registry key> <role>"``, else its class name."""
    label = getattr(cls, "label", None)
    if isinstance(label, str):
        return label
    key = getattr(cls, "registry_key", None)
    if key is None:
        return cls.__name__
    return f"{key} {role}" if role else str(key)


def check_fields(obj: Any, owner: str | None = None) -> None:
    """Check a dataclass instance's fields against its class's declared options (call it in ``__post_init__``)."""
    assert is_dataclass(obj)
    check_options(owner or owner_name(type(obj)), declared_options(obj),
                  {f.name: getattr(obj, f.name) for f in fields(obj)})


def checked_construction(cls: type, role: str) -> None:
    """Make constructing ``cls`` check its declared options first (the registry calls it when registering)."""
    init = cls.__init__  # type: ignore[misc]  # the class's own or inherited constructor, wrapped below
    if getattr(init, "_condcomp_checks_options", False):  # inherited from a registered class: checks type(self)'s
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            bound = None  # Python's own error, from the call below
        if bound is not None:
            bound.apply_defaults()
            check_options(owner_name(type(self), role), declared_options(type(self)), bound.arguments)
        init(self, *args, **kwargs)

    __init__._condcomp_checks_options = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def undeclared_numbers(cls: type, skip: Iterable[str] = ()) -> list[str]:
    """Constructor parameters of ``cls`` annotated as numbers (int, float, bool, or a schedule) that it declares
    no :class:`Option` for: what the registry-wide test refuses (``skip``: layer facts, given by the layer)."""
    declared = {o.name for o in declared_options(cls)}
    out = []
    for name, p in inspect.signature(cls).parameters.items():
        if name in declared or name in set(skip) or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        words = str(p.annotation).replace("None", "").replace("|", " ").replace("Optional", "").split()
        if any(w.strip("[]'\"") in ("int", "float", "bool", "ScheduleSpec") for w in words):
            out.append(name)
    return out


