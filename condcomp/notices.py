"""Warnings a wrapped model gives once: state on an object the model's layers share, not a module global."""

from __future__ import annotations

import warnings


class Notices:
    """What the layers of one wrapped model were already warned about, so each warning is given once: ``apply_``
    gives its layers one (``RoutingHost.notices``); a call passing none is warned every time.

    >>> notices = Notices()
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for _ in range(3):
    ...         notices.warn_once("gathered", "replaced", stacklevel=1)
    >>> len(caught)
    1
    """

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def warn_once(self, key: str, message: str, stacklevel: int) -> None:
        """A ``UserWarning`` with ``message`` unless one was given for ``key`` (``stacklevel`` as for warnings.warn
        called where this is)."""
        if key not in self.seen:
            self.seen.add(key)
            warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
