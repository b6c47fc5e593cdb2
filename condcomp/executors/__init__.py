"""Executors: backends that compute attention for a HeadPlan (registration happens on import)."""

from condcomp.executors import cached, gathered, masked, reference  # noqa: F401
from condcomp.executors.auto import explain, get_executor, resolve_executor

__all__ = ["explain", "get_executor", "resolve_executor"]
