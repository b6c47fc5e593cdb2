"""docs/extending-kv.md's policy, as a user saves it (the block marked ``saved as my_kv.py``), for the KV-policy
contract and ``bench kv`` tests (not a test module)."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending-kv.md"


def save_docs_policy(folder: Path) -> Path:
    """``folder/my_kv.py``: the page's file, exactly as printed there."""
    text = PAGE.read_text()
    found = re.search(r"<!-- docs-gate: saved as my_kv.py -->\n```python\n(.*?)\n```", text, re.S)
    assert found, f"{PAGE}: no block marked 'saved as my_kv.py'"
    path = folder / "my_kv.py"
    path.write_text(found.group(1) + "\n")
    return path
