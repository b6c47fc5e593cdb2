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


@pytest.fixture(autouse=True)
def _per_set_token_path_at_toy_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gathered token path projects routed heads per head set only when the sets' matmuls are large
    (``MIN_SET_WORK``); the tests' toy shapes never are. Lift the size rule so that every token test runs the
    per-set path; ``test_gathered.routed_path`` forces the per-head path, and the rule has its own test."""
    from condcomp.executors import gathered_token

    monkeypatch.setattr(gathered_token, "MIN_SET_WORK", 0)


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
