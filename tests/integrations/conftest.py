"""Fixtures of the integration tests (helpers live in integration_helpers.py)."""

from integration_helpers import prefer_router  # noqa: F401  (fixture)
