"""A local cache of converted models: a model read from a file that is slow to convert (SmolLM2's GGUF file,
dequantized by transformers in one to three minutes) is converted once and saved as safetensors; later loads read
that (seconds).

- **Where**: ``$CONDCOMP_CACHE`` when set, else ``~/.cache/condcomp``; one folder per model name and source file
  (``<root>/<name>/<sha256 of the source file>``). ``CONDCOMP_CACHE=none`` turns the cache off (every load
  converts; nothing is written).
- **Key**: the source file's content hash (SHA-256). Computing it reads the file once (a fraction of a second for
  93 MB); it is remembered per path, size and modification time (``<root>/source_hashes.json``), so an unchanged
  file is not read again. Another file, or the same path with other contents, is another entry.
- **Integrity**: an entry is written into a hidden folder and renamed into place whole, with a manifest
  (``condcomp_cache.json``) holding every file's size and SHA-256, checked at each load. An entry that fails the
  check (a crash mid-write, a truncated or altered file) is reported on stderr, deleted and converted again: it is
  never loaded.
- **Clearing**: :func:`clear_model_cache` or ``condcomp cache --clear`` (``condcomp cache`` lists the entries);
  deleting the folder by hand is safe too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_ENV = "CONDCOMP_CACHE"
MANIFEST = "condcomp_cache.json"
FORMAT = 1  # the manifest's layout; an entry of another format is converted again


def cache_root() -> Path | None:
    """``$CONDCOMP_CACHE`` (``none``: no cache), else ``~/.cache/condcomp``."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() == "none":
        return None
    return Path(env).expanduser() if env else Path.home() / ".cache" / "condcomp"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_key(source: Path, root: Path) -> str:
    """The SHA-256 of ``source``, remembered in ``root`` per (path, size, modification time)."""
    stat = source.stat()
    memo_path = root / "source_hashes.json"
    seen = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict) or not isinstance(memo.get(seen), str):
        memo = memo if isinstance(memo, dict) else {}
        memo[seen] = file_sha256(source)
        tmp = memo_path.with_name(f".{memo_path.name}.{os.getpid()}")
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(memo, indent=1))
            os.replace(tmp, memo_path)
        except OSError:  # not remembered: the next load hashes the file again (the save below says why)
            tmp.unlink(missing_ok=True)
    return str(memo[seen])


def entry_problem(entry: Path) -> str | None:
    """Why the cache entry ``entry`` cannot be used (a sentence), or None when every file matches its manifest."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"its manifest is missing or unreadable ({type(err).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
            manifest.get("files"), dict) or not manifest["files"]:
        return "its manifest is of another format"
    for name, want in manifest["files"].items():
        path = entry / name
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int) or not isinstance(
                want.get("sha256"), str):
            return f"its manifest's entry for {name} is not {{'bytes': int, 'sha256': str}}"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} holds {path.stat().st_size} bytes, the manifest {want['bytes']}"
        if file_sha256(path) != want["sha256"]:
            return f"{name}'s content differs from the manifest's hash"
    return None


def cached_model(name: str, source: Path, convert: Callable[[], tuple[Any, Any]],
                 load: Callable[[Path], tuple[Any, Any]]) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``source``: ``load(entry)`` of its cache entry when one passes the check, else
    ``convert()``, saved (:func:`save_converted`) as the entry for the next time."""
    root = cache_root()
    if root is None:
        return convert()
    entry = root / name / source_key(source, root)
    if entry.exists():
        problem = entry_problem(entry)
        if problem is None:
            return load(entry)
        print(f"condcomp: the cached conversion of {source.name} at {entry} is damaged ({problem}): converting "
              "again", file=sys.stderr)
        shutil.rmtree(entry, ignore_errors=True)
    model, tokenizer = convert()
    _save(entry, model, tokenizer, source)
    return model, tokenizer


def _save(entry: Path, model: Any, tokenizer: Any, source: Path) -> None:
    """Written aside and renamed into place whole: a crash leaves no entry (or a hidden folder), never half one."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{entry.name[:12]}.tmp-", dir=entry.parent))
    try:
        save_converted(model, tokenizer, work)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(work.iterdir())
                 if p.is_file()}
        (work / MANIFEST).write_text(json.dumps({"format": FORMAT, "source": str(source), "files": files}, indent=1))
        os.replace(work, entry)
    except OSError as err:  # a full disk or a read-only home: the model is still returned, uncached
        shutil.rmtree(work, ignore_errors=True)
        print(f"condcomp: could not cache the conversion of {source.name} in {entry.parent} ({err}); set "
              f"{CACHE_ENV} to a writable folder, or to none", file=sys.stderr)


def save_converted(model: Any, tokenizer: Any, folder: Path) -> None:
    """The model's config, generation config and weights (safetensors) and the tokenizer, in ``folder``, as
    ``from_pretrained(folder)`` reads them. transformers refuses ``save_pretrained`` on a model read from a GGUF
    file (its quantizer is not serializable); its weights are dequantized already, so they are saved as they are
    and the config without the GGUF quantization record."""
    from safetensors.torch import save_model

    config = json.loads(model.config.to_json_string())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(folder))


def cache_entries(root: Path | None = None) -> list[tuple[Path, int]]:
    """``(entry folder, bytes)`` of every cache entry under ``root`` (default :func:`cache_root`)."""
    root = root or cache_root()
    if root is None or not root.is_dir():
        return []
    return [(e, sum(p.stat().st_size for p in e.rglob("*") if p.is_file()))
            for e in sorted(root.glob("*/*")) if e.is_dir()]


def clear_model_cache(root: Path | None = None) -> int:
    """Delete every converted model under ``root`` (default :func:`cache_root`); returns the bytes freed."""
    root = root or cache_root()
    if root is None or not root.is_dir():
        return 0
    freed = sum(size for _, size in cache_entries(root))
    for folder in [p for p in root.iterdir() if p.is_dir()]:
        shutil.rmtree(folder)
    (root / "source_hashes.json").unlink(missing_ok=True)
    return freed


def main(args: argparse.Namespace) -> int:
    root = cache_root()
    if root is None:
        print(f"the model cache is off (${CACHE_ENV}=none)")
        return 0
    if args.clear:
        print(f"removed {clear_model_cache(root) / 1e6:.1f} MB of converted models from {root}")
        return 0
    entries = cache_entries(root)
    print(f"{root}: {len(entries)} converted model(s)")
    for entry, size in entries:
        print(f"  {entry.relative_to(root)}  {size / 1e6:.1f} MB")
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("cache", help="list or clear the cache of converted models (SmolLM2's GGUF file)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--clear", action="store_true", help="delete every converted model (they convert again on use)")
    p.set_defaults(func=main)
