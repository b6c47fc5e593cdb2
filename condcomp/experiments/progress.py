"""Progress bars: tqdm when installed (imported lazily), a plain line every ~10 % otherwise."""

from __future__ import annotations

import sys
from typing import Any


class _Plain:
    def __init__(self, total: int, initial: int = 0, desc: str | None = None) -> None:
        self.total, self.n, self.desc, self.last = max(1, total), initial, desc or "", -1

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        tenth = 10 * self.n // self.total
        if tenth != self.last:
            self.last = tenth
            extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
            print(f"{self.desc}: {self.n}/{self.total} {extra}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _Tqdm:
    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def update(self, n: int = 1, **postfix: Any) -> None:
        if postfix:
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()},
                                 refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def progress_bar(total: int, initial: int = 0, desc: str | None = None) -> Any:
    """An object with ``update(n, **postfix)`` and ``close()``; silent bars are not offered on purpose."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Plain(total, initial, desc)
    return _Tqdm(tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True,
                      mininterval=1.0, file=sys.stderr))
