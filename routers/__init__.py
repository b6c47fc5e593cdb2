"""Routers: which heads each input (or token) uses, and with what gates."""

from condcomp.routers import moh, norm, random, static, topk  # noqa: F401
