"""Text-classification data: local JSONL(.gz)/CSV with configurable fields, the staged datasets by name, and
Hugging Face ``datasets`` (by name, or any object iterable as dicts, such as a ``datasets.Dataset``).

Malformed rows raise :class:`DataError` naming the file and line; with ``skip_bad_rows=True`` they are skipped
and counted (the count ends up in metrics.json), never silently dropped.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from condcomp.files import FileError


class DataError(FileError):
    """A dataset file or row is not usable; the message names the file and line."""


@dataclass(frozen=True)
class DatasetSpec:
    """Where a staged dataset lives under the data dir and which fields it uses."""

    train: tuple[str, ...]
    test: tuple[str, ...]
    text_field: str = "text"
    pair_field: str | None = None
    label_field: str = "label"
    note: str = ""


# The project's staged test corpora (../shared/data beside a checkout; its SOURCES.md says where each comes from).
DATASETS: dict[str, DatasetSpec] = {
    "ag_news": DatasetSpec(("ag_news/train.jsonl.gz",), ("ag_news/test.jsonl.gz",),
                           note="official test; train texts are descriptions only"),
    "dbpedia_14": DatasetSpec(("dbpedia_14/train.jsonl.gz",), ("dbpedia_14/test.jsonl.gz",),
                              note="re-split of a 10k pool: not comparable with the official test set"),
    "imdb": DatasetSpec(tuple(f"imdb/train-0000{i}-of-00003.jsonl.gz" for i in range(3)), ("imdb/test.jsonl.gz",),
                        note="subsample of the official splits"),
    "snli": DatasetSpec(("snli/train.jsonl.gz",), ("snli/test.jsonl.gz",), text_field="premise",
                        pair_field="hypothesis", note="official test; 20k-pair train sample"),
    "yelp": DatasetSpec(("yelp/train.jsonl.gz",), ("yelp/test.jsonl.gz",),
                        note="test is a re-split of official-train rows: not comparable with the official test"),
}


@dataclass
class Records:
    """Raw examples of one split."""

    texts: list[str]
    pairs: list[str] | None
    labels: list[int]
    skipped: int = 0
    sources: list[str] = field(default_factory=list)


DATA_DIR_ENV = "CONDCOMP_DATA_DIR"
NO_DATA = "none"  # CONDCOMP_DATA_DIR=none: no staged corpora, as on a clone without ../shared (the tests use it)


def staged_data_dir(checkout: Path | None = None) -> Path | None:
    """The staged corpora's folder when no ``--data-dir`` is given: ``$CONDCOMP_DATA_DIR`` when set (``none``:
    there are none, even where ``../shared/data`` exists), else ``../shared/data`` relative to ``checkout`` (the
    working directory by default) when it exists, else None. A ``$CONDCOMP_DATA_DIR`` naming no folder raises."""
    env = os.environ.get(DATA_DIR_ENV)
    if env is not None and env.strip():
        if env.strip().lower() == NO_DATA:
            return None
        if not Path(env).is_dir():
            raise FileNotFoundError(f"${DATA_DIR_ENV}={env}: no such folder. Point it at the staged corpora's "
                                    f"folder, or set it to {NO_DATA!r} for none, or unset it")
        return Path(env)
    default = (checkout or Path(".")) / ".." / "shared" / "data"
    return default if default.is_dir() else None


OWN_DATA_ADVICE = ("For your own data use --dataset files --train-file F --test-file F (JSONL or CSV with text and "
                   "label fields), or --dataset hf:<name> (the datasets package); see docs/cli.md")


LLM_DATA_ADVICE = ("calibrate-kv and tune-llm read their texts from that folder (the corpora's gzipped JSONL files: "
                   "docs/kv-calibration.md); they have no --dataset option")


def resolve_data_dir(arg: str | None = None, advice: str = OWN_DATA_ADVICE) -> Path:
    """``arg``, else ``$CONDCOMP_DATA_DIR`` (``none``: no folder), else ``../shared/data`` relative to the working
    directory (:func:`staged_data_dir`); FileNotFoundError when there is none, saying what to pass instead
    (``advice``: what the calling command offers besides a data folder)."""
    if arg:
        if Path(arg).is_dir():
            return Path(arg)
        tried = f"--data-dir {arg}: no such folder"
    else:
        found = staged_data_dir()
        if found is not None:
            return found
        tried = (f"${DATA_DIR_ENV}={NO_DATA}" if os.environ.get(DATA_DIR_ENV, "").strip()
                 else f"../shared/data and ${DATA_DIR_ENV}: neither found")
    raise FileNotFoundError(f"data directory not found ({tried}). The named datasets "
                            f"({', '.join(sorted(DATASETS))}) are read from a folder in the layout of the project's "
                            f"staged corpora: pass --data-dir or set {DATA_DIR_ENV}. {advice}")


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")  # type: ignore[return-value]
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115


def iter_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, row)`` of a JSONL or CSV file (optionally gzipped); a bad JSON line yields its error."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    kind = path.name.removesuffix(".gz").rsplit(".", 1)[-1].lower()
    try:
        with _open_text(path) as fh:
            if kind in ("jsonl", "json", "ndjson"):
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        yield n, json.loads(line)
                    except json.JSONDecodeError as err:
                        yield n, DataError(f"{path}:{n}: not valid JSON ({err.msg} at column {err.colno})")
            elif kind in ("csv", "tsv"):
                reader = csv.DictReader(fh, delimiter="\t" if kind == "tsv" else ",")
                for row in reader:
                    yield reader.line_num, row
            else:
                raise DataError(f"{path}: unsupported file type {kind!r}; use .jsonl, .csv or .tsv (optionally .gz)")
    except UnicodeDecodeError as err:  # worded as condcomp.files words it (a dataset is streamed, not read whole)
        raise DataError(f"{path}: expected UTF-8 text, found byte 0x{err.object[err.start]:02x} that is not UTF-8 "
                        "(a binary file, or another encoding such as latin-1): convert it to UTF-8") from None
    except (OSError, EOFError) as err:  # a truncated or damaged .gz
        raise DataError(f"{path}: unreadable ({type(err).__name__}: {err})") from err


def _label(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a boolean label")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise TypeError(f"label {value!r} is not an integer")


def parse_rows(rows: Iterable[tuple[str, Any]], text_field: str, pair_field: str | None, label_field: str,
               skip_bad_rows: bool = False) -> Records:
    """Turn ``(where, row)`` pairs into :class:`Records`; ``where`` is ``"file:line"`` for error messages."""
    out = Records([], [] if pair_field else None, [])
    for where, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected an object with fields, got {type(row).__name__}")
            missing = [f for f in (text_field, pair_field, label_field) if f and f not in row]
            if missing:
                raise DataError(f"{where}: missing field(s) {missing}; present: {sorted(row)} (set --text-field/"
                                "--pair-field/--label-field)")
            text = row[text_field]
            pair = row[pair_field] if pair_field else None
            if not isinstance(text, str) or (pair_field and not isinstance(pair, str)):
                raise DataError(f"{where}: text fields must be strings")
            try:
                label = _label(row[label_field])
            except TypeError as err:
                raise DataError(f"{where}: {err}") from None
            if label < 0:
                raise DataError(f"{where}: negative label {label} (unlabelled rows must be removed)")
        except DataError as err:
            if not skip_bad_rows:
                raise DataError(f"{err} (pass --skip-bad-rows to skip and count malformed rows)") from None
            out.skipped += 1
            continue
        out.texts.append(text)
        if out.pairs is not None:
            out.pairs.append(pair)  # type: ignore[arg-type]
        out.labels.append(label)
    return out


def load_files(paths: Iterable[Path], text_field: str = "text", pair_field: str | None = None,
               label_field: str = "label", skip_bad_rows: bool = False) -> Records:
    """Records from local JSONL/CSV files (in order)."""
    paths = list(paths)

    def rows() -> Iterator[tuple[str, Any]]:
        for p in paths:
            for n, row in iter_rows(p):
                yield f"{p}:{n}", row

    rec = parse_rows(rows(), text_field, pair_field, label_field, skip_bad_rows)
    rec.sources = [str(p) for p in paths]
    return rec


def load_hf(source: Any, split: str, text_field: str = "text", pair_field: str | None = None,
            label_field: str = "label", skip_bad_rows: bool = False) -> Records:
    """Records from a Hugging Face dataset name (needs ``datasets`` and a network) or a dataset object."""
    if isinstance(source, str):
        try:
            import datasets
        except ImportError as err:
            raise RuntimeError("hf: datasets need the 'datasets' package: pip install datasets") from err
        source = datasets.load_dataset(source, split=split)
    name = getattr(source, "info", None) and getattr(source.info, "dataset_name", None) or "dataset"
    rec = parse_rows(((f"{name}[{split}] row {i}", row) for i, row in enumerate(source)), text_field,
                     pair_field, label_field, skip_bad_rows)
    rec.sources = [f"hf:{name}[{split}]"]
    return rec


def load_named(name: str, data_dir: Path, split: str, skip_bad_rows: bool = False) -> Records:
    """A staged dataset (``ag_news``, ``dbpedia_14``, ``imdb``, ``snli``, ``yelp``) from ``data_dir``."""
    if name not in DATASETS:
        raise KeyError(f"unknown dataset {name!r}; valid: {sorted(DATASETS)} (or pass --train-file/--test-file)")
    spec = DATASETS[name]
    files = spec.train if split == "train" else spec.test
    return load_files([data_dir / f for f in files], spec.text_field, spec.pair_field, spec.label_field,
                      skip_bad_rows)


def subsample(rec: Records, limit: int | None, seed: int) -> Records:
    """At most ``limit`` records, drawn with ``random.Random(seed)`` (order kept)."""
    if limit is None or len(rec.labels) <= limit:
        return rec
    keep = sorted(random.Random(seed).sample(range(len(rec.labels)), limit))
    pairs = [rec.pairs[i] for i in keep] if rec.pairs is not None else None
    return Records([rec.texts[i] for i in keep], pairs, [rec.labels[i] for i in keep], rec.skipped, rec.sources)
