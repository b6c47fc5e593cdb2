"""Stopping a benchmark cleanly when it is told to: ``SIGTERM`` (what ``timeout`` sends when a time limit runs out,
as the prepared device scripts use it) raises :class:`Stopped` in the main thread, and a benchmark that catches it
writes what it finished, marked stopped, instead of dying with nothing written.

:class:`Stopped` derives from ``BaseException``, as ``KeyboardInterrupt`` does, so that library code catching
``Exception`` (a compiler falling back, a retry loop) does not swallow it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Stopped(BaseException):
    """The run was told to stop (a signal); ``str()`` names it."""


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block, ``SIGTERM`` raises :class:`Stopped` (main thread only: elsewhere nothing changes); the
    previous handler is restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Stopped(f"stopped by {signal.Signals(signum).name} (a time limit, e.g. timeout)")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
