"""Routers: which heads each input (or token) uses, and with what gates."""

from condcomp.routers import random  # noqa: F401
