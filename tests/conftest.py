"""Fixtures shared by the tests: a fixed seed per test and throw-away registrations.

Builders (layouts, weights, plans) live in tests/core_helpers.py: import them from there, not from conftest,
which is ambiguous when several conftest.py files exist (tests/integrations/ has one).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from condcomp.registry import EXECUTORS, POLICIES, ROUTERS


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same global generator state (routers draw from it)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """Commands under test set torch's thread count (``--threads``, or 1 on a busy machine): give it back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def restore_registries() -> Iterator[None]:
    """Lets a test register throw-away components; the registries are put back afterwards."""
    saved = [(reg, dict(reg._entries)) for reg in (POLICIES, ROUTERS, EXECUTORS)]
    try:
        yield
    finally:
        for reg, entries in saved:
            reg._entries.clear()
            reg._entries.update(entries)
        from condcomp.executors import auto

        auto._INSTANCES.clear()
