"""The docs' shape: every user-guide page reads in one sitting, and every relative link leads somewhere.

- A guide page in docs/ holds at most ``MAX_WORDS`` words (counted as ``wc -w`` counts them: whitespace-separated
  runs, code blocks and tables included). A page that grows past it is split along the reader's tasks.
- Every relative link in README.md, docs/*.md, examples/README.md and results/**/README.md points to a file that
  exists and, with ``#anchor``, to a heading of that page, by GitHub's anchor rule: lowercase, punctuation
  dropped (letters, digits, ``-`` and ``_`` stay), spaces to ``-``, a repeated heading gets ``-1``, ``-2``, ...
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_WORDS = 2500
# Pages that are not guides, and why they may be longer:
EXEMPT = {
    # generated from the docstrings (python -m condcomp.docgen): a reference looked up by name, never read whole
    "docs/api.md": "generated API reference",
    # generated from the study's record (condcomp report --doc): a report beside its data, not a guide
    "docs/results.md": "generated study report",
    "docs/results-difficulty-target.md": "generated study report",
}
LINKED_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md",
                *sorted((ROOT / "results").glob("**/README.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (links and headings there are code, not markup)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_guide_page_reads_in_one_sitting() -> None:
    too_long = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        rel = page.relative_to(ROOT).as_posix()
        words = len(page.read_text().split())
        if rel not in EXEMPT and words > MAX_WORDS:
            too_long[rel] = words
    assert not too_long, (f"guide pages over {MAX_WORDS} words (split them along the reader's tasks, or cut "
                          f"repetition): {too_long}")


def test_the_exempt_pages_exist() -> None:
    # an exemption for a page that is gone (or renamed) would hide the next page of that name
    assert all((ROOT / rel).is_file() for rel in EXEMPT), EXEMPT


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    broken = []
    checked = 0
    for page in LINKED_PAGES:
        for line in prose(page.read_text()):
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                rel = page.relative_to(ROOT).as_posix()
                checked += 1
                if not file.exists():
                    broken.append(f"{rel}: {target} (no such file)")
                elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                    broken.append(f"{rel}: {target} (no heading with anchor #{anchor} in {file.name})")
    assert checked > 50, "the link parser found almost nothing: is it broken?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_anchor_rule_matches_github() -> None:
    # GitHub's slugs for headings of the kind these pages use (independent examples, written by hand)
    page = ("# Speed: `condcomp bench decode`\n## Paper names -> config fields\n## Notes\n## Notes\n"
            "```\n# not a heading\n```\n## Checkpoints (`condcomp.save_checkpoint` / `load_checkpoint`)\n")
    assert anchors(page) == {"speed-condcomp-bench-decode", "paper-names---config-fields", "notes", "notes-1",
                             "checkpoints-condcompsave_checkpoint--load_checkpoint"}
