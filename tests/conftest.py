"""Fixtures shared by the tests: a fixed seed per test and throw-away registrations; the ``--full`` option.

``pytest`` runs the fast suite (what a contributor runs before a commit); tests marked ``@pytest.mark.slow``
(trainings, studies, subprocesses, the docs gate's long blocks: seconds each) are deselected unless ``--full`` is
given (CI runs ``pytest -q --full``), ``-m`` chooses otherwise, or a test is named by its node id.

Tests marked ``@pytest.mark.needs_data`` need the project's staged corpora (``$CONDCOMP_DATA_DIR``, else
``../shared/data`` beside the checkout), which a clone does not have: without them they skip, saying so.
``CONDCOMP_DATA_DIR=none pytest -q --full`` runs the suite as a clone has it (CI does, then ``-m needs_data``).
CI adds ``-n 2 --dist loadfile`` (pytest-xdist, in the dev extra): two worker processes, each test file whole on one
of them, in file order (the docs gate's blocks of a page share a namespace).

Builders (layouts, weights, plans) live in tests/core_helpers.py: import them from there, not from conftest,
which is ambiguous when several conftest.py files exist (tests/integrations/ has one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from condcomp.registry import EXECUTORS, KV_POLICIES, POLICIES, ROUTERS


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked slow (the whole suite, as CI runs it)")


ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n N``) each worker gets its share of torch's intra-op threads (N processes at torch's
    default, one thread per core, would oversubscribe the machine N times)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_data"):
        from condcomp.experiments.data import staged_data_dir

        if staged_data_dir(ROOT) is None:
            pytest.skip("needs the staged corpora ($CONDCOMP_DATA_DIR, else ../shared/data beside the checkout), "
                        "which a clone does not have")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    named = [a.split("::", 1) for a in config.args if "::" in a]  # a test named by its node id runs, slow or not

    def was_named(item: pytest.Item) -> bool:
        file, _, test = item.nodeid.partition("::")
        return any(Path(f).name == Path(file).name and test.startswith(t) for f, t in named)

    slow = [i for i in items if i.get_closest_marker("slow") and not was_named(i)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if i not in set(slow)]


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--full") or config.getoption("markexpr"):
        return "condcomp: the whole suite (--full or -m)"
    return "condcomp: the fast suite; tests marked slow are deselected (--full runs them, as CI does)"


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
    saved = [(reg, dict(reg._entries)) for reg in (POLICIES, ROUTERS, EXECUTORS, KV_POLICIES)]
    try:
        yield
    finally:
        for reg, entries in saved:
            reg._entries.clear()
            reg._entries.update(entries)
        from condcomp.executors import auto

        auto._INSTANCES.clear()
