"""The text ``condcomp bench kv`` builds its haystacks from: the user's own, the project's staged corpora, or a small
corpus shipped with the package.

- :func:`builtin_texts`: ``condcomp/bench/data/haystack.txt``, fourteen paragraphs of plain everyday prose written
  for this package (about 5.7 KB, so that a clone runs with no download). Long prompts repeat it: each round is
  the paragraphs in a seeded order. Enough to check that a run works, not to measure a model (a model can copy a
  paragraph it has already read): bring text of your own for that.
- :func:`file_texts` / :func:`dir_texts`: plain text split into documents at blank lines, or JSON lines with a
  ``text`` field (``.jsonl``).
- :func:`hf_texts`: a Hugging Face dataset's text column, read with the ``datasets`` package (optional).
- :func:`choose_texts`: which of these a command line asked for, and the label its records carry.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

BUILTIN = "builtin"
STAGED = ("imdb", "ag_news", "yelp", "dbpedia_14", "snli")  # the staged corpora a haystack may be built from
DEFAULT_CORPORA = ("imdb", "ag_news", "yelp", "dbpedia_14")  # the haystack of every committed record
TEXT_SUFFIXES = (".txt", ".md", ".jsonl")


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def builtin_texts(seed: int = 0, rounds: int = 64) -> list[str]:
    """The shipped paragraphs, ``rounds`` times, each round in an order drawn from ``seed``."""
    text = resources.files("condcomp.bench").joinpath("data", "haystack.txt").read_text(encoding="utf-8")
    paragraphs = _paragraphs(text)
    rng = random.Random(f"builtin/{seed}")
    out: list[str] = []
    for _ in range(rounds):
        out.extend(rng.sample(paragraphs, len(paragraphs)))
    return out


def file_texts(path: Path) -> list[str]:
    """The documents of one file: ``.jsonl`` rows' ``text`` fields, else paragraphs (split at blank lines)."""
    from condcomp.files import read_text

    if not path.is_file():
        raise FileNotFoundError(f"--text-file {path}: no such file")
    raw = read_text(path, "a text file (.txt, .md: documents split at blank lines; .jsonl: one {\"text\": ...} "
                    "per line)", "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or pass a text file")
    if path.suffix != ".jsonl":
        return _paragraphs(raw)
    docs = []
    for i, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{i}: not a JSON line ({err}); a .jsonl text file holds one object with a "
                             "'text' field per line") from err
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"{path}:{i}: no string field 'text'; a .jsonl text file holds one object with a "
                             "'text' field per line (or use a .txt file: documents split at blank lines)")
        docs.append(row["text"])
    return docs


def dir_texts(folder: Path) -> list[str]:
    """The documents of every ``.txt``, ``.md`` and ``.jsonl`` file under ``folder``, files in sorted order."""
    if not folder.is_dir():
        raise FileNotFoundError(f"--text-dir {folder}: no such folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"--text-dir {folder}: no {', '.join(TEXT_SUFFIXES)} files in it")
    return [doc for f in files for doc in file_texts(f)]


def parse_hf_spec(spec: str) -> tuple[str, str, str]:
    """``NAME[:split[:column]]`` -> ``(name, split, column)``; split ``train``, column ``text`` by default.

    >>> parse_hf_spec("imdb"), parse_hf_spec("wikitext:test"), parse_hf_spec("ag_news:test:text")
    (('imdb', 'train', 'text'), ('wikitext', 'test', 'text'), ('ag_news', 'test', 'text'))
    """
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"--hf-dataset {spec!r}: expected NAME[:split[:column]], e.g. imdb:test:text")
    parts += [""] * (3 - len(parts))
    return parts[0], parts[1] or "train", parts[2] or "text"


def hf_texts(spec: str, limit: int = 2000) -> list[str]:
    """The first ``limit`` rows' text of a Hugging Face dataset (``NAME[:split[:column]]``), streamed."""
    name, split, column = parse_hf_spec(spec)
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"--hf-dataset {spec}: needs the datasets package (pip install datasets); or save the "
                          "text to a file and pass --text-file") from err
    rows = datasets.load_dataset(name, split=split, streaming=True)
    docs = []
    for row in rows:
        if column not in row:
            raise ValueError(f"--hf-dataset {spec}: no column {column!r} (columns: {', '.join(row)}); name it "
                             f"as {name}:{split}:COLUMN")
        if isinstance(row[column], str) and row[column].strip():
            docs.append(row[column])
        if len(docs) >= limit:
            break
    if not docs:
        raise ValueError(f"--hf-dataset {spec}: no text in column {column!r} of split {split!r}")
    return docs


def choose_texts(text_file: Path | None = None, text_dir: Path | None = None, hf_dataset: str | None = None,
                 data_dir: str | None = None, seed: int = 0, builtin: bool = False,
                 corpora: tuple[str, ...] | None = None) -> tuple[list[str] | None, str]:
    """``(texts, label)`` of the one source asked for. ``(None, "staged")``: the staged corpora (read by the run);
    with nothing asked, those when a data folder is found (``$CONDCOMP_DATA_DIR``, ``../shared/data``), else the
    built-in corpus (a line says so). ``corpora``: other staged corpora than the default four (``--corpora``: a
    second domain), labelled ``staged:<names>`` so that no record of the default haystack is read back for them."""
    asked = [flag for flag, v in (("--text-file", text_file), ("--text-dir", text_dir),
                                  ("--hf-dataset", hf_dataset), ("--builtin-text", builtin)) if v]
    staged = [flag for flag, v in (("--data-dir", data_dir), ("--corpora", corpora)) if v]
    if len(asked) > 1 or (asked and staged):
        together = " (--data-dir and --corpora together choose staged corpora)" if staged else ""
        raise ValueError(f"{' and '.join([*asked, *staged])}: give one text source{together}")
    if corpora and tuple(corpora) != DEFAULT_CORPORA:
        unknown = [c for c in corpora if c not in STAGED]
        if unknown:
            raise ValueError(f"--corpora {' '.join(unknown)}: not a staged corpus; choose from {', '.join(STAGED)}")
        return staged_texts(data_dir, tuple(corpora), seed), f"staged:{'+'.join(corpora)}"
    if text_file is not None:
        return file_texts(Path(text_file)), f"file:{Path(text_file).name}"
    if text_dir is not None:
        return dir_texts(Path(text_dir)), f"dir:{Path(text_dir).name}"
    if hf_dataset is not None:
        return hf_texts(hf_dataset), f"hf:{hf_dataset}"
    if data_dir is not None:
        return None, "staged"
    if not builtin:
        from condcomp.experiments.data import staged_data_dir

        if staged_data_dir() is not None:  # raises when $CONDCOMP_DATA_DIR names no folder
            return None, "staged"
        print("no staged corpora ($CONDCOMP_DATA_DIR, ../shared/data): the haystacks are the built-in corpus, "
              "a small sample that repeats; measure on your own text with --text-file, --text-dir or "
              "--hf-dataset")
    return builtin_texts(seed), BUILTIN


def staged_texts(data_dir: str | None, corpora: tuple[str, ...], seed: int) -> list[str]:
    """The staged corpora's test documents (``--data-dir``, else ``../shared/data``), in a seeded order."""
    from condcomp.bench.kv_cases import corpus_texts
    from condcomp.experiments.data import resolve_data_dir

    try:
        folder = resolve_data_dir(data_dir)
    except FileNotFoundError as err:  # its advice names train/ablate's flags; these are bench kv's
        raise FileNotFoundError(
            f"--data-dir {data_dir or '../shared/data'}: no staged corpora there (the project's layout of "
            f"{', '.join(corpora)}). Measure on your own text with --text-file PATH, --text-dir DIR or "
            "--hf-dataset NAME[:split[:column]], or on the small built-in corpus with --builtin-text") from err
    return corpus_texts(folder, corpora, seed)


def add_text_arguments(parser: Any) -> None:
    """``bench kv``'s haystack-text options (one of them; :func:`choose_texts` reads them)."""
    text = parser.add_argument_group("haystack text (one of; default: the staged corpora at ../shared/data when "
                                     "present, else the built-in corpus)")
    text.add_argument("--text-file", type=Path, default=None,
                      help="your own text: a .txt file (documents split at blank lines) or .jsonl ('text' field)")
    text.add_argument("--text-dir", type=Path, default=None, help="every .txt, .md and .jsonl file under a folder")
    text.add_argument("--hf-dataset", default=None, metavar="NAME[:split[:column]]",
                      help="a Hugging Face dataset's text (needs the datasets package; split train, column text by "
                           "default), its first 2000 rows")
    text.add_argument("--data-dir", default=None,
                      help="the project's staged corpora (imdb, ag_news, yelp, dbpedia_14 test splits)")
    text.add_argument("--corpora", nargs="+", choices=STAGED, default=None,
                      help=f"which staged corpora (default {' '.join(DEFAULT_CORPORA)}; e.g. snli alone: a second "
                           "domain of short sentences)")
    text.add_argument("--builtin-text", action="store_true",
                      help="the small corpus shipped with condcomp (checks a run works; too small to measure on)")
