"""Registering a name that is taken is an error unless the caller says override=True; an override takes effect at
once, also for an executor that has already run (reference: the registered class itself, called directly)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import condcomp
from condcomp.executors.reference import ReferenceExecutor
from condcomp.registry import EXECUTORS, POLICIES, ROUTERS


@pytest.mark.parametrize("register,name", [(condcomp.register_router, "topk"), (condcomp.register_policy, "fixed"),
                                           (condcomp.register_executor, "masked")])
def test_taken_names_are_refused(register: object, name: str, restore_registries: None) -> None:
    registry = {condcomp.register_router: ROUTERS, condcomp.register_policy: POLICIES}.get(register, EXECUTORS)
    builtin = registry.get(name)

    class Mine(nn.Module):
        pass

    with pytest.raises(ValueError, match=f"'{name}' is already registered .*override=True"):
        register(name)(Mine)  # type: ignore[operator]
    assert registry.get(name) is builtin
    register(name, override=True)(Mine)  # type: ignore[operator]
    assert registry.get(name) is Mine


def test_the_same_definition_may_register_again(restore_registries: None) -> None:
    class Again(nn.Module):
        pass

    condcomp.register_router("test_again")(Again)
    condcomp.register_router("test_again")(Again)  # a re-run cell or reloaded module: no error
    assert ROUTERS.get("test_again") is Again


def test_an_executor_override_takes_effect_after_the_old_one_ran(restore_registries: None) -> None:
    calls: list[str] = []

    class Counting(ReferenceExecutor):
        def __call__(self, *args: object) -> torch.Tensor:
            calls.append("new")
            return super().__call__(*args)

    model = nn.Sequential(condcomp.HeadAttention(16, 4))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor="reference"))
    x = torch.randn(2, 3, 16)
    want = model(x)  # the built-in reference has run (and its instance is cached)
    condcomp.register_executor("reference", override=True)(Counting)
    torch.testing.assert_close(model(x), want)
    assert calls == ["new"]


def test_a_subclass_registered_under_its_own_key_reports_that_key(restore_registries: None) -> None:
    """docs/gpu-kernels.md's way to run another tuning: a ``GatheredExecutor`` subclass registered as
    ``gathered_triton``. ``head_usage`` names the registered key, not the parent's ``gathered``; a
    class that sets its own name keeps it."""
    from dataclasses import replace

    from condcomp.executors.gathered import CPU, GatheredExecutor

    @condcomp.register_executor("test_gathered_tuned")
    class Tuned(GatheredExecutor):
        def __init__(self) -> None:
            super().__init__(tuning=replace(CPU, static_sequence=True))

    @condcomp.register_executor("test_reference_named")
    class Named(ReferenceExecutor):
        name = "my_reference"

    model = nn.Sequential(condcomp.HeadAttention(16, 4))
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk",
                                                   executor="test_gathered_tuned"))
    model(torch.randn(2, 3, 16))
    assert {u.executor for u in condcomp.head_usage(model).values()} == {"test_gathered_tuned"}
    model = nn.Sequential(condcomp.HeadAttention(16, 4))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor="test_reference_named"))
    model(torch.randn(2, 3, 16))
    assert {u.executor for u in condcomp.head_usage(model).values()} == {"my_reference"}
