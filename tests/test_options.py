"""The one option check (:mod:`condcomp.options`): every numeric option is declared, and declared options are checked
wherever the component is built, the command line included.

The hostile-value property over every declared option is tests/test_option_properties.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from torch import nn

import condcomp
from condcomp.executors.gathered import GatheredTuning
from condcomp.experiments.llm.command import NUMBER_FLAGS
from condcomp.experiments.llm.tuning import TuneSettings
from condcomp.kv.window import StreamWindow
from condcomp.options import count, declared_options, undeclared_numbers
from condcomp.registry import EXECUTORS, KV_POLICIES, LAYER_FACTS, POLICIES, ROUTERS, Registry

REGISTRIES = (POLICIES, ROUTERS, EXECUTORS, KV_POLICIES)
SETTINGS = (condcomp.CondCompConfig, GatheredTuning, StreamWindow, TuneSettings)


def test_every_numeric_constructor_parameter_of_a_registered_component_declares_its_check() -> None:
    # a new option annotated int, float, bool or a schedule without an Option fails here, naming it
    missing = {f"{r.role} {n}": undeclared_numbers(c, LAYER_FACTS) for r in REGISTRIES for n, c in r.entries()
               if isinstance(c, type) and c.__module__.startswith("condcomp.")}  # the package's, not a test's
    missing |= {c.__name__: undeclared_numbers(c) for c in SETTINGS}
    assert not any(missing.values()), {k: v for k, v in missing.items() if v}


def test_the_declaration_test_catches_an_undeclared_number(registry: Registry[Any]) -> None:
    @registry.register("mine")
    class Mine(nn.Module):
        options = (count("width", at_least=1),)

        def __init__(self, num_heads: int, width: int = 2, scale: float | None = None, name: str = "x") -> None:
            super().__init__()

    assert undeclared_numbers(Mine, LAYER_FACTS) == ["scale"]
    with pytest.raises(ValueError, match=r"mine policy: width must be a whole number >= 1 .*got 0"):
        registry.build("mine", {"width": 0}, {"num_heads": 4})  # a user's class: checked when built
    with pytest.raises(ValueError, match=r"mine policy: width must be a whole number"):
        Mine(num_heads=4, width=2.5)  # and when constructed directly


@pytest.fixture
def registry() -> Registry[Any]:
    return Registry("policy")


@pytest.mark.parametrize("field", ["lr", "kl_temperature", "router_lr", "lora_alpha"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_tune_llm_settings_refuse_non_finite_numbers(field: str, bad: float) -> None:
    # red team round 5, item 4: TuneSettings(lr=inf) and (kl_temperature=inf) were accepted (only the flags checked)
    # and trained to NaN; the flags and the settings now read one declaration
    with pytest.raises(ValueError, match=rf"tune-llm settings: {field} .*must be a finite number > 0"):
        TuneSettings(**{field: bad})
    assert TuneSettings(**{field: 2.0}).__dict__[field] == 2.0


def test_tune_llm_flags_are_the_settings_declarations() -> None:
    import argparse

    numeric = {f.name for f in dataclasses.fields(TuneSettings) if f.type in ("int", "float", "float | None")}
    assert set(NUMBER_FLAGS) == numeric == {o.name for o in declared_options(TuneSettings)}
    for flag, text in (("lr", "inf"), ("kl_temperature", "inf"), ("seq_len", "1"), ("steps", "2.5")):
        with pytest.raises(argparse.ArgumentTypeError):
            NUMBER_FLAGS[flag](text)
    assert NUMBER_FLAGS["lr"]("0.01") == 0.01 and NUMBER_FLAGS["steps"]("3") == 3


@pytest.mark.parametrize("value, why", [(math.nan, "not finite"), (10**400, "not finite in float64"),
                                        ("0.5", "not a number"), (True, "a bool, not a number")])
def test_a_fraction_is_a_finite_number(value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=rf"fixed policy: fraction .* got .* \({why}\)"):
        condcomp.CondCompConfig(policy=("fixed", {"fraction": value}))


def test_a_flag_is_a_bool_not_a_truthy_string() -> None:
    # bool("false") is True: a string would silently turn the option on
    with pytest.raises(TypeError, match="moh router: two_stage .* must be True or False, got 'false'"):
        condcomp.CondCompConfig(router=("moh", {"two_stage": "false"}))
    with pytest.raises(TypeError, match="CondCompConfig: share_policy must be True or False, got 'false'"):
        condcomp.CondCompConfig(share_policy="false")


def test_a_schedule_must_stay_finite_over_training() -> None:
    with pytest.raises(ValueError, match=r"topk router: temperature .* \(not finite over training\)"):
        condcomp.CondCompConfig(router=("topk", {"temperature": {"kind": "linear", "start": 2.0, "end": math.nan}}))
