"""What a good option value is, and what a component built with one must do, written apart from
:mod:`condcomp.options` and the components: for tests/test_option_properties.py.

- :func:`acceptable`: a value's verdict from its declared kind and bounds alone (the Python types themselves, not the
  option check's code): True, False, or None where a schedule spec's own rules decide (either answer is allowed then);
- :func:`fixed_k`: the fixed policy's budget in float64, ``clamp(floor(f * H), k_min, H)``, up to float32's rounding
  of ``f``;
- :func:`kv_kept`: the prompt tokens each key/value group of a token-selecting KV policy keeps after a prefill,
  counted by hand (window: sinks + recent; snapkv: the observation window + its budget; adakv: the same summed over
  the layer's groups).
"""

from __future__ import annotations

import math
from typing import Any

from condcomp.options import Option


def _within(opt: Option, x: float) -> bool:
    return ((opt.above is None or x > opt.above) and (opt.at_least is None or x >= opt.at_least)
            and (opt.below is None or x < opt.below) and (opt.at_most is None or x <= opt.at_most))


def acceptable(opt: Option, v: Any) -> bool | None:
    """Whether ``v`` is a good value of ``opt`` (None: a schedule spec, its kind's own rules decide)."""
    if v is None:
        return opt.optional
    if opt.kind == "flag":
        return type(v) is bool
    if type(v) is bool:
        return False
    if opt.kind == "schedule" and isinstance(v, dict):
        return None
    if opt.kind == "count":
        return type(v) is int and _within(opt, v)
    if type(v) not in (int, float):
        return False
    try:
        x = float(v)
    except OverflowError:
        return False
    return math.isfinite(x) and _within(opt, x)


def fixed_k(fraction: float, H: int, k_min: int) -> set[int]:
    """The fixed policy's k in float64; two values where float32's rounding of ``fraction`` may cross an integer."""
    tol = 1e-6 * H
    return {min(max(math.floor(fraction * H + d), k_min), H) for d in (-tol, tol)}


def kv_kept(policy: Any, T: int, groups: int) -> list[int] | int:
    """Prompt tokens kept per group after a prefill of ``T`` real tokens (adakv: their sum over the ``groups``)."""
    name = type(policy).__name__
    if name == "WindowKV":
        recent = policy.window if policy.model_window is None else min(policy.window, policy.model_window)
        return [min(T, policy.sinks + recent)] * groups
    if name == "HeadKV":  # without shares: fraction of the prompt in all, else sinks + recent + budget
        if policy.fraction is not None:
            return [math.floor(T * policy.fraction + 1e-9)] * groups
        extra = 64 if policy.budget is None else policy.budget
        return [min(T, policy.sinks + (policy.observe if policy.window is None else policy.window) + extra)] * groups
    window = getattr(policy, "window", None)  # adakv's recent tokens (None: the observation window)
    recent = min(policy.observe if window is None else window, T)
    if policy.fraction is not None:
        budget = max(math.floor(T * policy.fraction + 1e-9) - recent, 0)
    else:
        budget = 64 if policy.budget is None else policy.budget
    if name == "AdaKV":
        return groups * recent + min(groups * budget, groups * (T - recent))
    return [recent + min(budget, T - recent)] * groups
