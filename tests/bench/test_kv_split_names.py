"""``bench kv``'s split variants by name, ``split-duo-<a>of<b>-w<W>[+fp8|+hqq4]``: the name's fraction of the
gates file's (layer, KV group) pairs in full, the others 4 sinks + W tokens; the cache it fills holds the bytes
counted by hand; the table's own names keep their meaning; malformed names are refused with the grammar."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import condcomp
from condcomp.bench import kv_variants
from condcomp.bench.kv_variants import MODELS, VARIANTS, ModelContext, cache_bytes, check_names, split_variant
from condcomp.experiments.llm.duo_gates import save_gates

t = pytest.importorskip("transformers")

L, H, G, DH = 2, 6, 3, 8
# (layer, group) gates: the highest third of the 6 pairs is (0, 2) and (0, 0); layer 1 keeps no group in full
SCORES = [[0.8, 0.1, 0.9], [0.3, 0.2, 0.4]]


@pytest.fixture
def gates_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A gates file for the tiny model at the path the split names read (results/kv/duo_gates.json, relative to
    the working folder); the variant tables put back afterwards."""
    monkeypatch.chdir(tmp_path)
    save_gates(tmp_path / kv_variants.DUO_GATES, "duo", "tiny", torch.tensor(SCORES), 4, 252, {})
    variants, models = dict(VARIANTS), dict(MODELS)
    yield tmp_path
    VARIANTS.clear(), VARIANTS.update(variants), MODELS.clear(), MODELS.update(models)


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=H * DH, intermediate_size=64, num_hidden_layers=L, num_attention_heads=H,
                           num_key_value_heads=G, vocab_size=97, max_position_embeddings=64)
    return t.LlamaForCausalLM(config).eval()


def unused() -> torch.Tensor:
    raise AssertionError("a gates split needs no importance ranking")


def test_a_named_split_holds_the_bytes_counted_by_hand(gates_here: Path) -> None:
    name = "split-duo-1of3-w5"
    check_names([name], None)
    v = VARIANTS[name]
    assert (v.model, v.cache) == ("duo-1of3-w5", None) and "1/3" in v.note and "4 sink + 5 recent" in v.note
    model = MODELS[v.model](llama(), ModelContext(importance=unused))
    B, T = 2, 20
    ids = torch.randint(1, 97, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    plans = list(condcomp.request_plans(model, out.past_key_values).values())
    assert [p.group_modes()[0] for p in plans] == [["full", "window", "full"], ["window"] * 3]
    f32, i64, N = 4, 8, 4 + 5  # a window holds 4 sinks + 5 recent tokens
    # layer 0: 2 groups' keys and values for every token, 1 group's window with its positions (B, N) and seen (B,)
    layer0 = 2 * B * 2 * T * DH * f32 + 2 * B * 1 * N * DH * f32 + i64 * (B * N + B)
    # layer 1: no group in full: a (B, 1, T, 1) placeholder for keys and for values counts the tokens; 3 windows
    layer1 = 2 * B * T * f32 + 2 * B * 3 * N * DH * f32 + i64 * (B * N + B)
    assert cache_bytes(out.past_key_values) == layer0 + layer1
    dense = 2 * L * B * G * T * DH * f32
    assert cache_bytes(out.past_key_values) / dense == pytest.approx((layer0 + layer1) / dense)


def test_names_compose_with_the_quantized_caches_and_share_one_model(gates_here: Path) -> None:
    names = ["split-duo-1of2-w124", "split-duo-1of2-w124+fp8", "split-duo-1of2-w124+hqq4"]
    check_names(names, None)
    assert [VARIANTS[n].cache for n in names] == [None, "fp8", "hqq4"]
    assert {VARIANTS[n].model for n in names} == {"duo-1of2-w124"}  # one prefill serves the three


def test_the_table_names_keep_their_meaning() -> None:
    assert (VARIANTS["split-duo-1of3"].model, VARIANTS["split-duo-1of3"].cache) == ("duo-1of3-w252", None)
    assert VARIANTS["split-duo-1of3+fp8"].cache == "fp8" and VARIANTS["split-duo-1of3-seed1"].model.endswith("seed1")
    assert split_variant("split-duo-1of3") is VARIANTS["split-duo-1of3"]
    # the same split written in the grammar is the table's model (one prefill, the same groups)
    assert split_variant("split-duo-1of3-w252").model == VARIANTS["split-duo-1of3"].model  # type: ignore[union-attr]
    assert split_variant("split-duo-1of6-w92") is VARIANTS["split-duo-1of6-w92"]
    assert split_variant("dense") is VARIANTS["dense"] and split_variant("quantized-int3") is None


@pytest.mark.parametrize("name,why", [
    ("split-duo-1of3-w", "does not read as the grammar"),
    ("split-duo-1of3-seed2", "does not read as the grammar"),
    ("split-duo-3of3-w64", "0 < a < b"),
    ("split-duo-0of3-w64", "0 < a < b"),
    ("split-duo-2of6-w64", r"lowest terms \(split-duo-1of3-w64"),
    ("split-duo-1of3-w0", "at least 1"),
    ("split-duo-1of3-w64+int8", r"fp8 or hqq4, got \+int8"),
    ("split-duo-1of3-w64+fp8+hqq4", "does not read as the grammar"),
])
def test_a_malformed_split_name_is_refused_with_the_grammar(name: str, why: str) -> None:
    grammar = re.escape("split-duo-<a>of<b>-w<W>[+fp8|+hqq4]")
    with pytest.raises(ValueError, match=rf"kv variant '{re.escape(name)}'.*{why}.*{grammar}"):
        check_names(["dense", name], None)
    assert name not in VARIANTS


def test_an_unknown_name_lists_the_table_and_the_grammar() -> None:
    with pytest.raises(ValueError, match=r"unknown kv variant\(s\) \['splitduo'\].*split-duo-<a>of<b>-w<W>"):
        check_names(["splitduo"], None)
