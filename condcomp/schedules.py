"""Schedules of training progress ``p`` in [0, 1]: temperature, noise std, entropy coefficient beta(t), ...

A schedule is a tiny frozen dataclass with ``__call__(p) -> float`` and a JSON-friendly spec, so it can sit in
``CondCompConfig`` kwargs: ``{"kind": "linear", "start": 2.0, "end": 0.1}``. A bare number is a constant.
Components keep the progress they were last given by ``condcomp.set_progress(model, p)`` and read their
schedules at that progress; nothing reads a global step counter.

>>> linear = make_schedule({"kind": "linear", "start": 2.0, "end": 0.0})
>>> linear(0.0), linear(0.25), linear(1.0)
(2.0, 1.5, 0.0)
>>> make_schedule(0.5)(0.9)
0.5
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Schedule(Protocol):
    """A number as a function of training progress ``p`` in [0, 1]."""

    def __call__(self, progress: float) -> float: ...

    def to_spec(self) -> dict[str, Any]: ...


def _check_progress(progress: float) -> float:
    p = float(progress)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"schedule progress must be in [0, 1], got {progress}")
    return p


@dataclass(frozen=True)
class Constant:
    """``value`` at every progress."""

    value: float

    def __call__(self, progress: float) -> float:
        _check_progress(progress)
        return float(self.value)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": "constant", **asdict(self)}


@dataclass(frozen=True)
class Linear:
    """``start + (end - start) * p``."""

    start: float
    end: float

    def __call__(self, progress: float) -> float:
        p = _check_progress(progress)
        return float(self.start + (self.end - self.start) * p)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": "linear", **asdict(self)}


@dataclass(frozen=True)
class Cosine:
    """Half-cosine from ``start`` to ``end``: flat at both ends, fastest change at ``p = 0.5``."""

    start: float
    end: float

    def __call__(self, progress: float) -> float:
        p = _check_progress(progress)
        return float(self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * p)))

    def to_spec(self) -> dict[str, Any]:
        return {"kind": "cosine", **asdict(self)}


@dataclass(frozen=True)
class Exponential:
    """Geometric interpolation ``start * (end / start) ** p`` (the usual temperature annealing).

    ``start`` and ``end`` must be non-zero and of the same sign; use ``linear`` or ``cosine`` to cross zero.
    """

    start: float
    end: float

    def __post_init__(self) -> None:
        if self.start == 0 or self.end == 0 or (self.start > 0) != (self.end > 0):
            raise ValueError(f"exponential schedule needs non-zero start and end of the same sign, got "
                             f"start={self.start}, end={self.end}; use 'linear' or 'cosine' to cross zero")

    def __call__(self, progress: float) -> float:
        p = _check_progress(progress)
        return float(self.start * (self.end / self.start) ** p)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": "exponential", **asdict(self)}


SCHEDULE_KINDS: dict[str, type] = {"constant": Constant, "linear": Linear, "cosine": Cosine,
                                   "exponential": Exponential}

ScheduleSpec = float | int | dict[str, Any] | Schedule


def make_schedule(spec: ScheduleSpec, name: str = "schedule") -> Schedule:
    """A schedule from a number (constant), a dict spec ``{"kind": ..., ...}`` or a schedule object.

    ``name`` (the option being built, e.g. ``"temperature"``) only makes error messages clearer.
    """
    if isinstance(spec, bool):
        raise TypeError(f"{name}: expected a number or a schedule spec, got {spec!r}")
    if isinstance(spec, (int, float)):
        return Constant(float(spec))
    if isinstance(spec, dict):
        kind = spec.get("kind")
        if kind not in SCHEDULE_KINDS:
            raise ValueError(f"{name}: schedule 'kind' must be one of {sorted(SCHEDULE_KINDS)}, got {kind!r} "
                             f"(e.g. {{'kind': 'linear', 'start': 2.0, 'end': 0.1}})")
        cls = SCHEDULE_KINDS[kind]
        fields = {k: v for k, v in spec.items() if k != "kind"}
        try:
            return cls(**{k: float(v) for k, v in fields.items()})  # type: ignore[no-any-return]
        except TypeError as err:
            params = list(cls.__dataclass_fields__)  # type: ignore[attr-defined]
            raise ValueError(f"{name}: a {kind!r} schedule takes {params}, got {sorted(fields)}") from err
    if isinstance(spec, Schedule):
        return spec
    raise TypeError(f"{name}: expected a number, a dict like {{'kind': 'linear', 'start': 2.0, 'end': 0.1}} or a "
                    f"schedule object, got {spec!r}")


def schedule_range(schedule: Schedule, points: int = 11) -> tuple[float, float]:
    """(min, max) of a schedule over ``points`` evenly spaced progress values (for validating options).

    Exact for the built-in kinds, which are monotone between their end points.
    """
    values = [schedule(i / (points - 1)) for i in range(points)]
    return min(values), max(values)
