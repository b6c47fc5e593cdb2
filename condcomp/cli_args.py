"""Argument checks shared by every ``condcomp`` command.

What a flag names is checked when the command line is parsed, before any data, model or benchmark is loaded,
and a mistake is one line that names the flag, what is wrong and what to pass instead:

>>> import argparse
>>> p = argparse.ArgumentParser()
>>> _ = p.add_argument("--out", type=output_folder)
>>> p.parse_args(["--out", "runs/new"]).out
PosixPath('runs/new')

- ``output_folder``: a folder to write into (created if missing); an existing file, or a path under one, is refused.
- ``output_file``: a file to write; an existing folder, or a path under a file, is refused.
- ``json_object`` / ``json_object_file``: a JSON object given inline or in a file; a list or a number is refused.
- ``folders_with``: the folders among some that hold results (``--report-only``); none is an error.
- ``finite_float`` / ``integer``: a number in a range (``nan`` and ``inf`` refused), e.g.
  ``type=finite_float(above=0)`` for a learning rate, ``type=integer(at_least=1)`` for a count.
- ``component(role)``: a user's router or policy, a registered name or ``module:Class`` (imported and registered).
- ``compile_backend``: a ``torch.compile`` backend torch knows; ``COMPILE_MODES``: the modes of its inductor backend.
- ``OneLineParser``: the ``argparse`` parser that reports any of these (and every other usage mistake) in one line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from condcomp.options import Option


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit status 2), not usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is not a folder (nothing can be created under it)."""
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def output_folder(value: str | Path) -> Path:
    """A folder the command writes into: new or existing, never an existing file."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is an existing file, not a folder; pass a folder to write into "
                                         "(it is created if missing)")
    above = _file_above(path)
    if above is not None:
        raise argparse.ArgumentTypeError(f"{above} is a file, so the folder {value} cannot be created under it")
    return path


def output_file(value: str | Path) -> Path:
    """A file the command writes (replacing it if present), never an existing folder."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a folder; pass the path of a file to write")
    above = _file_above(path)
    if above is not None:
        raise argparse.ArgumentTypeError(f"{above} is a file, so {value} cannot be created under it")
    return path


def _object_or_error(value: Any, source: str, example: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        kind = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise argparse.ArgumentTypeError(f"{source} holds {kind}; it must be a JSON object like {example}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """An inline JSON object, e.g. ``'{"fraction": 0.25}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({err})") from None
    return _object_or_error(value, repr(text), '\'{"fraction": 0.25}\'')


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path``; a missing file, bad JSON or another JSON value: a ``ValueError``."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    try:
        return _object_or_error(value, str(path), '{"dataset": "ag_news", "lr": 0.001}')
    except argparse.ArgumentTypeError as err:
        raise ValueError(str(err)) from None


def json_object_file(value: str | Path) -> Path:
    """The path of a file holding a JSON object (checked now; the command reads it)."""
    try:
        read_json_object(Path(value))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return Path(value)


def folders_with(folders: Iterable[Path | None], pattern: str, flags: str, what: str) -> list[Path]:
    """The folders among ``folders`` holding at least one file matching ``pattern`` (a glob), in order.

    None of them: a ``ValueError`` naming the folders looked in, ``flags`` and ``what`` was looked for.
    """
    given = [f for f in dict.fromkeys(folders) if f is not None]
    found = [f for f in given if f.is_dir() and next(iter(f.glob(pattern)), None) is not None]
    if not found:
        looked = ", ".join(str(f) for f in given) or "no folder"
        raise ValueError(f"{flags}: no {what} in {looked} (no {pattern}); pass the folder a run wrote")
    return found



def _number_type(option: Option, text_kind: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that parses with ``convert`` and checks with ``option`` (:mod:`condcomp.options`, the
    check every component's numeric options go through)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {text_kind}") from None
        why = option.problem(value)
        if why is None:
            return value
        if why.startswith("not finite"):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number; pass {option.wanted()}")
        raise argparse.ArgumentTypeError(f"{text} is out of range; pass {option.wanted()}")

    return parse


def finite_float(above: float | None = None, at_least: float | None = None, below: float | None = None,
                 at_most: float | None = None) -> Callable[[str], float]:
    """An argparse ``type``: a finite number within the bounds given (``above``/``below`` exclusive,
    ``at_least``/``at_most`` inclusive); ``nan``, ``inf`` and anything outside are refused, naming the range."""
    parse = _number_type(Option("value", "real", at_least=at_least, above=above, at_most=at_most, below=below),
                         "a number", float)
    parse.__name__ = "finite_float"
    return parse


def integer(at_least: int | None = None, at_most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number within ``[at_least, at_most]`` (``at_most`` default
    :data:`condcomp.options.MAX_COUNT`, 2**40: every count a command takes is far below it)."""
    parse = _number_type(Option("value", "count", at_least=at_least, at_most=at_most), "a whole number", int)
    parse.__name__ = "integer"
    return parse


def option_type(option: Option) -> Callable[[str], Any]:
    """The argparse ``type`` of a declared :class:`~condcomp.options.Option` (a count or a finite number)."""
    if option.kind == "count":
        return integer(at_least=None if option.at_least is None else int(option.at_least),
                       at_most=None if option.at_most is None else int(option.at_most))
    return finite_float(above=option.above, at_least=option.at_least, below=option.below, at_most=option.at_most)


def component(role: str) -> Callable[[str], str]:
    """An argparse type for a user's ``role`` (``"router"`` or ``"policy"``): a registered name or a
    ``module:Class`` spec, imported and registered now (a module that does not import, or a name that is not
    registered, is refused with what to pass). The value is kept as given: a run records the spec."""

    def check(value: str) -> str:
        from condcomp.experiments.classification.user_components import resolve

        try:
            resolve(role, value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    check.__name__ = role  # argparse names the type in its messages
    return check


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's modes


def compile_backend(value: str) -> str:
    """An argparse ``type``: a ``torch.compile`` backend torch knows (``torch._dynamo.list_backends``), checked when
    parsed: a misspelt backend failed only once the model was loaded and decoded eagerly."""
    if value in ("inductor", "eager", "aot_eager"):
        return value
    import torch._dynamo

    known = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if value not in known:
        raise argparse.ArgumentTypeError(f"unknown torch.compile backend {value!r}; pass one of {', '.join(known)}")
    return value

