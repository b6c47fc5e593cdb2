"""Writing a set of files into a directory so that a crash leaves the old set or the new one, never half of one.

Each file is written under a temporary name beside its final one and flushed to disk; only when every file is
written are they renamed into place, in the order they were staged, so the last one staged (a manifest listing the
others) is the commit record. A new directory is built as a hidden sibling and renamed into place in one step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType


class StagedDirectory:
    """``with StagedDirectory(d) as stage: write to stage.path(name) ...``: the files are renamed into ``d`` when
    the block ends without an exception (and the names in ``remove`` deleted from it); with one, nothing in ``d``
    changes that was not already renamed, and the temporary files are deleted."""

    def __init__(self, directory: Path, remove: Iterable[str] = ()) -> None:
        self.directory, self.remove = directory, list(remove)
        self.fresh = not directory.exists()
        directory.parent.mkdir(parents=True, exist_ok=True)
        self.work = (Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent)) if self.fresh
                     else directory)
        self.staged: list[tuple[Path, Path]] = []  # (temporary, final) in rename order

    def path(self, name: str) -> Path:
        """Where to write the file ``name`` now; it is renamed to ``name`` after the files staged before it."""
        tmp = self.work / f".{name}.tmp-{os.getpid()}"
        self.staged.append((tmp, self.work / name))
        return tmp

    def __enter__(self) -> StagedDirectory:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is not None:
            self._discard()
            return
        try:
            self._commit()
        except BaseException:
            self._discard()
            raise

    def _commit(self) -> None:
        for tmp, _ in self.staged:
            _fsync(tmp)
        for tmp, final in self.staged:
            os.replace(tmp, final)
        for name in self.remove:
            (self.work / name).unlink(missing_ok=True)
        if self.fresh:
            os.replace(self.work, self.directory)

    def _discard(self) -> None:
        if self.fresh:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            for tmp, _ in self.staged:
                tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
