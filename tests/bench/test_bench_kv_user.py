"""``condcomp bench kv --variants module:Name / file.py:Name``: a user's KV policy (docs/extending-kv.md's, saved
as the page says) or model factory as a variant beside the built-in ones, and clear errors for a bad spec."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from condcomp.bench import kv_user
from condcomp.bench.kv_variants import MODELS, VARIANTS
from condcomp.registry import KV_POLICIES

sys.path.insert(0, str(Path(__file__).parents[1] / "kv"))
from docs_kv_example import save_docs_policy  # noqa: E402

TEXTS = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(60))
         for i in range(40)]
FACTORY = '''
import torch
from condcomp.kv.calibration import static_split


def streaming(model):
    """StreamingLLM as the built-in 'streaming' variant builds it: every group 4 sinks + 252 recent tokens."""
    return static_split(model, torch.zeros(4, 8), 0.0, window=252, sinks=4)


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder holding my_kv.py (the docs page's policy) and factories.py; the variants and registry put back."""
    save_docs_policy(tmp_path)
    (tmp_path / "factories.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = (dict(VARIANTS), dict(MODELS), dict(KV_POLICIES._entries))
    KV_POLICIES._entries.pop("first_tokens", None)
    yield tmp_path
    for table, before in zip((VARIANTS, MODELS, KV_POLICIES._entries), saved):
        table.clear()
        table.update(before)
    sys.modules.pop("factories", None)


@pytest.mark.slow
def test_a_user_policy_and_factory_run_beside_the_builtin_variants(user_folder: Path) -> None:
    pytest.importorskip("transformers")
    from condcomp.bench import kv

    importance = user_folder / "zeros.json"
    importance.write_text(json.dumps({"group_importance": [[0.0] * 8] * 4}))
    preset = replace(kv.PRESETS["quick"], prompts=(300,), passkey_cases=2, ppl_cases=1, cont_len=4, answer_tokens=3)
    names = ["streaming", "my_kv.py:FirstTokensKV", "factories:streaming"]
    result = kv.run("tiny-llama", user_folder / "out", preset, names, threads=1, texts=TEXTS, timed=[],
                    importance_file=importance)
    records = {r["variant"]: r for r in result["records"]}
    assert set(records) == {"dense", "streaming", "user-firsttokenskv", "user-streaming"}
    assert "my_kv.py:FirstTokensKV" in VARIANTS["user-firsttokenskv"].note
    # the factory rebuilds the built-in variant: the same numbers
    mine, builtin = records["user-streaming"], records["streaming"]
    for key in ("kv_frac", "ppl", "retrieval_correct", "token_nll"):
        assert mine[key] == builtin[key], key
    # the page's policy holds every group: 4 first tokens of 300 (+ a placeholder), well under the dense cache
    first = records["user-firsttokenskv"]
    assert 0 < first["kv_frac"] < 0.05 and first["ppl"] > 0 and len(first["retrieval_correct"]) == 2


def test_bad_specs_are_refused_saying_what_to_write(user_folder: Path) -> None:
    with pytest.raises(ValueError, match=r"no file missing.py"):
        kv_user.add_user_variants(["missing.py:X"], None)
    with pytest.raises(ValueError, match=r"cannot import no_such_module .*PYTHONPATH"):
        kv_user.add_user_variants(["no_such_module:X"], None)
    with pytest.raises(ValueError, match=r"my_kv.py has no attribute 'Nope' \(it has: .*FirstTokensKV"):
        kv_user.add_user_variants(["my_kv.py:Nope"], None)
    with pytest.raises(ValueError, match=r"FirstTokens is a class but not a condcomp.KVPolicy subclass"):
        kv_user.add_user_variants(["my_kv.py:FirstTokens"], None)
    with pytest.raises(ValueError, match=r"NOT_CALLABLE is a int; name a KVPolicy subclass or a function"):
        kv_user.add_user_variants(["factories:NOT_CALLABLE"], None)
    with pytest.raises(ValueError, match=r"write module:Name or path/to/file.py:Name"):
        kv_user.add_user_variants(["my_kv.py:"], None)


def test_specs_become_variant_names_in_names_and_timed(user_folder: Path) -> None:
    names, timed = kv_user.add_user_variants(["dense", "my_kv.py:FirstTokensKV"], ["my_kv.py:FirstTokensKV"])
    assert names == ["dense", "user-firsttokenskv"] and timed == ["user-firsttokenskv"]
    assert KV_POLICIES.get("first_tokens").__name__ == "FirstTokensKV"  # registered by its own decorator
    assert kv_user.add_user_variants(["my_kv.py:FirstTokensKV"], None)[0] == ["user-firsttokenskv"]  # again: same


def test_the_command_line_takes_a_spec(user_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from condcomp.cli import main

    code = main(["bench", "kv", "--model", "tiny-llama", "--variants", "dense", "my_kv.py:Nope",
                 "--out", str(user_folder / "out"), "--builtin-text"])
    assert code != 0 and "my_kv.py has no attribute 'Nope'" in capsys.readouterr().err
