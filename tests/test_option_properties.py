"""Hostile values for every declared numeric option (hypothesis): refused by name, or the component runs by its rule.

For every registered policy, router, executor and KV policy, each option it declares (``options``, see
:mod:`condcomp.options`), and for the settings objects (``CondCompConfig``, ``GatheredTuning``, ``StreamWindow``,
``TuneSettings``),
hypothesis draws nan, inf, -inf, huge and negative integers, 0, floats for counts, bools, strings, None, lists and
schedule specs. The outcome must be a ``ValueError``/``TypeError`` that names the option and the component, or (only
for a value that is good by :func:`option_rules.acceptable`, written from the declared kind and bounds alone) a
component that runs: a policy's budget is the float64 rule ``clamp(floor(s * H), k_min, H)`` of its own ``s`` (the
fixed policy's of its fraction), a router keeps the heads its budget gives (the shared heads plus the rest of ``k``
for moh/norm), a KV policy keeps the prompt tokens counted by hand, a tuned gathered executor equals the reference
executor. Examples per option: 10 (``CONDCOMP_DEEP_EXAMPLES=N`` reruns deeper).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from option_rules import acceptable, fixed_k, kv_kept

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import GatheredExecutor, GatheredTuning
from condcomp.experiments.llm.tuning import TuneSettings
from condcomp.kv.window import StreamWindow
from condcomp.options import Option, declared_options
from condcomp.registry import EXECUTORS, KV_POLICIES, POLICIES, ROUTERS, Registry
from condcomp.testing import FACTS, B, D, H, T
from condcomp.types import AttentionInputs, Budget

EXAMPLES = int(os.environ.get("CONDCOMP_DEEP_EXAMPLES", "0")) or 10
NUMBERS = [math.nan, math.inf, -math.inf, 2**62, 10**30, -(2**62), 2**40, 2**40 + 1, -1, -0.5, 0, 0.0, 1, 1.0, 0.5,
           2.5, 3, 7, True, False, "3", "nan", None, [1]]
ENDS = st.sampled_from([math.nan, math.inf, -1.0, 0.0, 0.5, 2.0])
HOSTILE = st.one_of(
    st.sampled_from(NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.builds(lambda kind, a, b: {"kind": kind, "start": a, "end": b},
              st.sampled_from(["linear", "cosine", "exponential"]), ENDS, ENDS),
)
COMPONENTS = [(registry, name, option) for registry in (POLICIES, ROUTERS, EXECUTORS, KV_POLICIES)
              for name, cls in registry.entries() if getattr(cls, "__module__", "").startswith("condcomp.")
              for option in declared_options(cls)]
SETTINGS = [(cls, label, option) for cls, label in ((condcomp.CondCompConfig, "CondCompConfig"),
                                                    (GatheredTuning, "GatheredTuning"), (StreamWindow, "StreamWindow"),
                                                    (TuneSettings, "tune-llm settings"))
            for option in declared_options(cls)]
HYPOTHESIS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    return torch.randn(B, T, D, generator=g), mask


def _given(option: Option, value: Any, name: str, default: Any) -> Any:
    return value if option.name == name and value is not None else default


def _run_policy(policy: Any, option: Option, value: Any) -> None:
    x, mask = _inputs()
    with torch.no_grad():
        extra = {"condition": torch.randn(B, policy.condition_dim)} if getattr(policy, "reads_condition", False) else {}
        budget = policy(x, mask, **extra)
    k, s = budget.k, budget.s.double()
    assert k.dtype == torch.int64 and bool(((k >= 0) & (k <= H)).all()) and bool(s.isfinite().all())
    k_min = _given(option, value, "k_min", 1)
    if type(policy).__name__ == "FixedPolicy":
        fraction = _given(option, value, "fraction", 0.5)
        assert set(k.flatten().tolist()) <= fixed_k(float(fraction), H, k_min)
        return
    if s.dim() == 2:  # per token: padding gets no heads
        k, s = k[mask], s[mask]
    assert all(int(ki) in fixed_k(float(si), H, k_min) for ki, si in zip(k, s))


def _run_router(router: Any, option: Option, value: Any) -> None:
    x, mask = _inputs()
    token = router.granularity == "token"
    shape = (B, T) if token else (B,)
    router.eval()
    budget, weights = Budget(torch.full(shape, 0.5), torch.full(shape, 4)), condcomp.HeadAttention(D, H).weights()
    with torch.no_grad():
        plan = router(x, mask, budget, weights)
    assert bool(plan.gates.isfinite().all())
    counts = plan.counts
    if not token:
        assert counts.tolist() == [4] * B  # every sequence router here keeps k heads (static: of all H by default)
        return
    shared = _given(option, value, "shared_heads", H // 2)
    want = shared + min(max(4 - shared, 0), H - shared)  # shared heads on, then the rest of k among the routed
    assert counts[mask].tolist() == [want] * int(mask.sum()) and counts[~mask].tolist() == [0] * int((~mask).sum())


def _run_kv(policy: Any) -> None:
    G, P = 2, 24
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, G, P, 4, generator=g, dtype=torch.float64) for _ in range(3))
    extra = {"slot_valid": torch.ones(1, G, dtype=torch.bool)} if policy.reads_slot_validity else {}
    if policy.stores != "own":
        return  # drop and full keep nothing of their own (and declare no options)
    out, _, state = policy.attend(q, k, v, None, None, 0.5, True, **extra)
    assert bool(out.isfinite().all())
    held = state.positions[0] >= 0  # (N,) window: one row of positions shared by the groups; (G, N) snapkv
    kept = [int(held.sum())] * G if held.dim() == 1 else [int(c) for c in held.sum(-1)]
    want = kv_kept(policy, P, G)
    assert (sum(kept) if isinstance(want, int) else kept) == want


@pytest.mark.parametrize("registry, name, option", COMPONENTS,
                         ids=[f"{r.role.replace(' ', '_')}-{n}-{o.name}" for r, n, o in COMPONENTS])
@HYPOTHESIS
@given(value=HOSTILE)
def test_a_hostile_option_is_refused_by_name_or_the_component_runs_by_its_rule(registry: Registry[Any], name: str,
                                                                               option: Option, value: Any) -> None:
    verdict = acceptable(option, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # topk(stream_window=): a shorthand, still accepted
        try:
            built = registry.build(name, {option.name: value}, {} if registry is KV_POLICIES else FACTS)
        except (ValueError, TypeError) as err:  # refused (a good value may still break a relation: named too)
            assert option.name in str(err) and name in str(err), f"{name}: {option.name}={value!r}: {err}"
            return
    assert verdict is not False, f"{registry.role} {name} accepted {option.name}={value!r}"
    if registry is POLICIES:
        _run_policy(built, option, value)
    elif registry is ROUTERS:
        _run_router(built, option, value)
    elif registry is KV_POLICIES:
        _run_kv(built)


@pytest.mark.parametrize("cls, label, option", SETTINGS, ids=[f"{c.__name__}-{o.name}" for c, _, o in SETTINGS])
@HYPOTHESIS
@given(value=HOSTILE)
def test_a_hostile_setting_is_refused_by_name_or_the_settings_work(cls: type, label: str, option: Option,
                                                                   value: Any) -> None:
    verdict = acceptable(option, value)
    try:
        obj: Any = cls(**{option.name: value})
    except (ValueError, TypeError) as err:
        assert option.name in str(err) and label in str(err), f"{label}: {option.name}={value!r}: {err}"
        return
    assert verdict is not False, f"{label} accepted {option.name}={value!r}"
    if cls is StreamWindow:
        assert obj.capacity == obj.sinks + (obj.window if obj.model_window is None else min(obj.window,
                                                                                             obj.model_window))
    if cls is GatheredTuning:  # the executor tuned so still computes what the reference does
        torch.manual_seed(0)
        w = condcomp.HeadAttention(16, 4).weights()
        inputs = AttentionInputs(x=torch.randn(2, 5, 16))
        for active in (torch.rand(2, 4) < 0.5, torch.rand(2, 5, 4) < 0.5):  # a sequence and a token plan
            plan = condcomp.plan_from_active(active)
            with torch.no_grad():
                torch.testing.assert_close(GatheredExecutor(tuning=obj)(w, inputs, plan),
                                           get_executor("reference")(w, inputs, plan), atol=1e-5, rtol=1e-4)


def test_every_declared_option_is_a_constructor_parameter() -> None:
    # a declaration that names no parameter checks nothing (a renamed option would slip through)
    import inspect

    stale = {f"{r.role} {n}": [o.name for o in declared_options(c) if o.name not in inspect.signature(c).parameters]
             for r, n, _ in COMPONENTS for c in [r.get(n)]}
    stale |= {label: [o.name for o in declared_options(c) if o.name not in {f.name for f in dataclasses.fields(c)}]
              for c, label, _ in SETTINGS}
    assert not any(stale.values()), stale
