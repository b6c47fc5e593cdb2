"""Tests generated from the registries: every policy, router and executor, including ones added after this file.

Each policy and router is built the way ``apply_`` builds it (``Registry.build(name, {}, layer facts)``, default
options) and put through ``condcomp.testing`` (the contract a user runs on their own components): shape,
forward, backward, no NaN, every parameter receives a gradient, k = 0 / 1 / H, padding, bfloat16 input, and a
forward/backward through ``RoutedAttention`` with every executor able to run it. ``tests/test_testing.py`` shows
that each of those checks fails on a component that breaks it.

Declaring a parameter non-trainable (docs/extending.md): set ``requires_grad=False`` on it, or list its name
(as ``named_parameters`` spells it) in a class attribute ``non_trainable = ("name", ...)``.
"""

from __future__ import annotations

import pytest

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.registry import EXECUTORS
from condcomp.testing import check_policy, check_router


@pytest.mark.parametrize("name", condcomp.list_policies())
def test_policy(name: str) -> None:
    """The policy contract, and this policy + the random router end to end (auto executor)."""
    check_policy(name)


@pytest.mark.parametrize("name", condcomp.list_routers())
def test_router(name: str) -> None:
    """The router contract, and fixed(0.5) + this router through every executor able to run its plans."""
    check_router(name)


@pytest.mark.parametrize("name", condcomp.list_executors())
def test_executor_declares_itself(name: str) -> None:
    ex = get_executor(name)
    assert isinstance(ex, condcomp.Executor)
    assert ex.name == name and EXECUTORS.get(name) is type(ex)
    assert set(ex.granularities) <= {"sequence", "token"} and ex.granularities


@pytest.mark.parametrize("kind", ["policy", "router", "executor"])
def test_config_json_round_trip_for_every_component(kind: str) -> None:
    names = {"policy": condcomp.list_policies, "router": condcomp.list_routers,
             "executor": condcomp.list_executors}[kind]()
    for name in names:
        cfg = condcomp.CondCompConfig(**{"policy": "full", "router": "random", "executor": "auto", kind: name})
        again = condcomp.CondCompConfig.from_json(cfg.to_json())
        assert again == cfg, name
        assert condcomp.CondCompConfig.from_dict(cfg.to_dict()) == cfg, name


def test_config_from_a_0_1_file_with_the_empty_extra_field() -> None:
    """0.1 wrote an always-empty ``extra`` field (nothing read it; it is gone): such configs still load."""
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random")
    assert condcomp.CondCompConfig.from_dict({**cfg.to_dict(), "extra": {}}) == cfg
    with pytest.raises(ValueError, match="extra"):
        condcomp.CondCompConfig.from_dict({**cfg.to_dict(), "extra": {"x": 1}})
