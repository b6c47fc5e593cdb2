"""``condcomp bench kv``: its cases, its byte counter, its cache conversion, its resumable records, a tiny run."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from condcomp.bench.kv_cases import INSTRUCTION, NEEDLE, QUESTION, answer_correct, continuation_cases, passkey_cases

TEXTS = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(60))
         for i in range(40)]


def byte_encode(text: str) -> list[int]:
    return list(text.encode())


def stream() -> list[int]:
    from condcomp.bench.kv_cases import haystack_stream

    return haystack_stream(TEXTS, byte_encode, 10, min_tokens=5000)


def test_passkey_case_plants_the_key_at_the_asked_depth() -> None:
    s = stream()
    cases = passkey_cases(s, byte_encode, 600, n=10, seed=3)
    head = len(byte_encode(INSTRUCTION))
    for case in cases:
        assert len(case.ids) == 600
        text = bytes(case.ids).decode()
        assert text.startswith(INSTRUCTION) and text.endswith(QUESTION)
        needle = NEEDLE.format(key=case.key)
        assert bytes(case.ids[case.needle_start:case.needle_end]).decode() == needle
        assert text.count(case.key) == 2 and len(case.key) == 5  # planted once (the needle names it twice)
        hay = 600 - head - len(needle) - len(QUESTION)  # haystack tokens around the needle
        assert abs((case.needle_start - head) - case.depth * hay) <= 0.5
    assert [c.depth for c in cases[:5]] == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert passkey_cases(s, byte_encode, 600, n=10, seed=3) == cases  # deterministic from the seed
    assert [c.key for c in passkey_cases(s, byte_encode, 600, n=10, seed=4)] != [c.key for c in cases]


def test_chat_passkey_format_wraps_the_prompt_in_the_template() -> None:
    from condcomp.bench.kv_cases import chat_format

    def render(user: str) -> str:  # a chat template: the user turn, then the assistant's turn opened
        return f"<u>{user}</u><a>"

    fmt = chat_format(render)
    s = stream()
    for case in passkey_cases(s, byte_encode, 600, n=5, seed=0, fmt=fmt):
        text = bytes(case.ids).decode()
        assert len(case.ids) == 600
        assert text.startswith("<u>" + INSTRUCTION) and text.endswith("What is the pass key?</u><a>The pass key is")
        assert text[case.needle_start:case.needle_end] == NEEDLE.format(key=case.key)


def test_passkey_format_names_are_checked() -> None:
    from condcomp.bench.kv_presets import ByteTokenizer, passkey_format

    assert passkey_format("raw", ByteTokenizer()).tail == QUESTION
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        passkey_format("chat", ByteTokenizer())
    with pytest.raises(ValueError, match="unknown passkey format"):
        passkey_format("fancy", ByteTokenizer())


def test_continuation_cases_are_stream_windows() -> None:
    s = stream()
    cases = continuation_cases(s, 100, 20, n=3, seed=0)
    for case in cases:
        assert len(case) == 121
        assert any(s[o:o + 121] == case for o in range(len(s) - 120))
    assert continuation_cases(s, 100, 20, n=3, seed=0) == cases
    with pytest.raises(ValueError, match="fewer than one case"):
        continuation_cases(s[:50], 100, 20, n=1, seed=0)


def test_answer_is_an_exact_match_on_the_first_number() -> None:
    assert answer_correct(" 12345.", "12345") and not answer_correct(" 1234", "12345")
    assert not answer_correct(" 99999 12345", "12345")


def tiny_llama(layers: int = 2, heads: int = 6, kv_heads: int = 3) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=300,
                                      max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


def test_cache_bytes_against_a_hand_count() -> None:
    from condcomp.bench.kv_variants import cache_bytes, cache_from_prefill

    model = tiny_llama(layers=2, heads=6, kv_heads=3)  # head_dim 8
    ids = torch.randint(0, 300, (2, 10))
    with torch.inference_mode():
        source = model(input_ids=ids, use_cache=True).cache
    L, B, Hkv, T, Dh = 2, 2, 3, 10, 8
    assert cache_bytes(source) == L * 2 * B * Hkv * T * Dh * 4  # keys and values, float32
    fp8 = cache_from_prefill(source, "fp8", model.config)
    assert cache_bytes(fp8) == L * 2 * (B * Hkv * T * Dh * 1 + 4)  # one byte each, one float32 scale per tensor


def _continuation_logits(model: torch.nn.Module, cache: object, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("kind", ["fp8", "hqq4"])
def test_quantizing_a_prefill_equals_prefilling_the_quantized_cache(kind: str) -> None:
    from condcomp.bench.kv_variants import cache_from_prefill, missing_packages, quantized_cache

    if missing_packages({"fp8": "quantized-fp8", "hqq4": "quantized-hqq4"}[kind]):
        pytest.skip(f"{kind} needs the kvquant extra")
    model = tiny_llama()
    ids = torch.randint(0, 300, (2, 24))
    with torch.inference_mode():
        direct = model(input_ids=ids[:, :16], cache=quantized_cache(kind, model.config), use_cache=True).cache
        source = model(input_ids=ids[:, :16], use_cache=True).cache
    converted = cache_from_prefill(source, kind, model.config)
    want = _continuation_logits(model, direct, ids[:, 16:])
    got = _continuation_logits(model, converted, ids[:, 16:])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dense = _continuation_logits(model, cache_from_prefill(source, None, model.config), ids[:, 16:])
    assert not torch.equal(got, dense)  # the quantized cache is read: its rounding shows


def test_compact_cache_inside_a_quantized_cache() -> None:
    """condcomp's compact cache (a static 1-of-3 split) filled straight into an fp8 QuantizedCache equals the
    converted prefill, holds a third of the fp8 bytes, and matches the dense model with the dropped groups'
    heads zeroed when read back at full precision (the composition's reference)."""
    from condcomp.bench.kv_variants import ModelContext, cache_bytes, cache_from_prefill, quantized_cache, static_split

    model = tiny_llama()
    importance = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3]], dtype=torch.float64)  # keeps group 1, then 0
    wrapped = static_split(1 / 3)(model, ModelContext(importance=lambda: importance))
    ids = torch.randint(0, 300, (2, 24))
    with torch.inference_mode():
        direct = wrapped(input_ids=ids[:, :16], cache=quantized_cache("fp8", model.config), use_cache=True).cache
        source = wrapped(input_ids=ids[:, :16], use_cache=True).cache
    converted = cache_from_prefill(source, "fp8", model.config)
    assert cache_bytes(converted) == cache_bytes(direct) == 2 * 2 * (2 * 1 * 16 * 8 + 4)  # 1 of 3 groups kept
    torch.testing.assert_close(_continuation_logits(wrapped, converted, ids[:, 16:]),
                               _continuation_logits(wrapped, direct, ids[:, 16:]), rtol=0, atol=0)
    # reference: the unwrapped model with the dropped groups' query heads gated to zero at o_proj's input
    keep = {0: [2, 3], 1: [0, 1]}  # layer -> kept query heads (group g: heads 2g, 2g+1)

    def gate(layer: int):  # noqa: ANN202
        def pre(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0].clone().view(*args[0].shape[:2], 6, 8)
            mask = torch.zeros(6, dtype=torch.bool)
            mask[keep[layer]] = True
            x[:, :, ~mask] = 0
            return (x.view(args[0].shape),)
        return pre

    handles = [model.model.layers[i].self_attn.o_proj.register_forward_pre_hook(gate(i)) for i in range(2)]
    try:
        with torch.inference_mode():
            reference = model(input_ids=ids).logits[:, 16:]
    finally:
        for h in handles:
            h.remove()
    full = _continuation_logits(wrapped, cache_from_prefill(source, None, model.config), ids[:, 16:])
    torch.testing.assert_close(full, reference, rtol=1e-4, atol=1e-4)


def test_records_are_read_back_only_with_the_same_settings(tmp_path: Path) -> None:
    from condcomp.bench.kv import read_record, record_path, write_record

    path = record_path(tmp_path, "dense", 1024)
    assert read_record(path, {"a": 1}) is None
    write_record(path, {"variant": "dense", "settings": {"a": 1}})
    assert read_record(path, {"a": 1}) == {"variant": "dense", "settings": {"a": 1}}
    assert read_record(path, {"a": 2}) is None
    path.write_text("{half")
    assert read_record(path, {"a": 1}) is None


@pytest.mark.slow
def test_tiny_run_end_to_end_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from condcomp.bench import kv, kv_report

    preset = replace(kv.PRESETS["quick"], prompts=(300,), passkey_cases=2, ppl_cases=1, cont_len=4,
                     decode_prompt=16, decode_tokens=2, answer_tokens=3)
    names = ["dense", "quantized-fp8", "drop-keep1of3"]
    result = kv.run("tiny-llama", tmp_path, preset, names, threads=1, texts=TEXTS, timed=["quantized-fp8"])
    kv_report.write(tmp_path, result)
    records = {r["variant"]: r for r in json.loads((tmp_path / "metrics.json").read_text())["records"]}
    assert set(records) == set(names)
    for r in records.values():
        assert {"variant", "prompt_len", "kv_frac", "ppl", "retrieval_acc", "decode_ms_per_token"} <= set(r)
        assert r["prompt_len"] == 300 and r["retrieval_n"] == 2 and r["ppl_tokens"] == 4 and r["task"] == "facts"
        assert len(r["retrieval_correct"]) == 2 and sum(r["retrieval_correct"]) / 2 == r["retrieval_acc"]
        assert len(r["token_nll"]) == 1 and len(r["token_nll"][0]) == 4  # one window of 4 scored tokens
        assert r["ppl"] == pytest.approx(math.exp(sum(r["token_nll"][0]) / 4), rel=1e-4)
        timed = r["variant"] in ("dense", "quantized-fp8")  # only the asked variant is timed, dense as the base
        assert (r["decode_ms_per_token"] is not None) == timed
    # the tiny Llama has 8 key/value heads: 1/3 of them rounds to 3 kept; fp8: a byte per value plus scales
    assert records["dense"]["kv_frac"] == 1.0
    assert records["drop-keep1of3"]["kv_frac"] == pytest.approx(3 / 8)
    assert records["quantized-fp8"]["kv_frac"] == pytest.approx(0.25, abs=1e-3)
    assert "| 300 | drop-keep1of3 |" in (tmp_path / "summary.md").read_text()

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished (variant, length) was measured again")

    monkeypatch.setattr(kv, "measure_length", must_not_run)
    monkeypatch.setattr(kv, "time_decode", must_not_run)
    again = kv.run("tiny-llama", tmp_path, preset, names, threads=1, texts=TEXTS, timed=["quantized-fp8"])
    assert [r["ppl"] for r in again["records"]] == [r["ppl"] for r in result["records"]]


def test_cases_of_a_length_do_not_depend_on_the_other_lengths(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A record at one length is reused by runs that also measure other lengths: its cases must be the same."""
    pytest.importorskip("transformers")
    from condcomp.bench import kv

    seen: dict[tuple[int, ...], list[list[int]]] = {}

    def capture(bench: object, todo: list[str], cont: list[list[int]], keys: list[object], *rest: object) -> dict:
        seen.setdefault(current, []).extend([*cont, *[list(k.ids) for k in keys]])  # type: ignore[attr-defined]
        raise StopIteration  # the cases are all this test needs

    monkeypatch.setattr(kv, "measure_length", capture)
    base = replace(kv.PRESETS["quick"], passkey_cases=2, ppl_cases=1, cont_len=4, answer_tokens=3)
    for current in [(300,), (300, 900)]:
        with pytest.raises(StopIteration):
            kv.run("tiny-llama", tmp_path / str(len(current)), replace(base, prompts=current), ["dense"],
                   threads=1, texts=TEXTS, timed=[])
    assert seen[(300,)] == seen[(300, 900)]


def test_other_prompt_lengths_keep_each_lengths_case_counts() -> None:
    from condcomp.bench.kv_presets import PRESETS

    cpu = PRESETS["cpu"]  # 1024 and 2048: 2 and 5 continuations
    assert cpu.at_lengths((2048,)).cases(2048) == (10, 5)
    assert cpu.at_lengths((1024, 4096)).cases(1024) == (10, 2)
    assert cpu.at_lengths((1024, 4096)).cases(4096) == (10, 5)  # a new length: the longest one's counts
    assert PRESETS["cpu-2048"].at_lengths((2048, 4096)).cases(4096) == (10, 4)


@pytest.mark.slow
def test_a_new_variant_reads_the_finished_dense_record_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from condcomp.bench import kv

    preset = replace(kv.PRESETS["quick"], prompts=(300,), passkey_cases=2, ppl_cases=1, cont_len=4,
                     answer_tokens=3)
    first = kv.run("tiny-llama", tmp_path, preset, ["dense", "drop-keep1of3"], threads=1, texts=TEXTS, timed=[])
    measured: list[list[str]] = []
    original = kv.measure_length

    def spy(bench: Any, names: list[str], *args: Any) -> Any:
        measured.append(list(names))
        return original(bench, names, *args)

    monkeypatch.setattr(kv, "measure_length", spy)
    again = kv.run("tiny-llama", tmp_path, preset, ["dense", "drop-keep1of3", "drop-keep2of3"], threads=1,
                   texts=TEXTS, timed=[])
    assert measured == [["drop-keep2of3"]]  # dense (the kv_frac reference) and drop-keep1of3 read back
    records = {r["variant"]: r for r in again["records"]}
    assert records["dense"] == first["records"][0]
    assert records["drop-keep2of3"]["kv_frac"] == pytest.approx(5 / 8)  # round(2/3 * 8) of 8 groups


def test_passkey_pairs_each_variant_with_dense_on_the_same_cases() -> None:
    from condcomp.bench.kv_report import paired_with_dense

    dense = {"passkey_correct": [True, True, True, False, False, True]}
    # the variant finds case 3 that dense misses and loses cases 0 and 1: 1 / 2 discordant;
    # exact two-sided binomial on 3 discordant cases: 2 * P(X <= 1 | n 3, 1/2) = 2 * 4 / 8 = 1
    variant = {"passkey_correct": [False, False, True, True, False, True]}
    assert paired_with_dense(variant, dense) == "1 / 2, p 1.00"
    lost = {"passkey_correct": [False] * 6}  # loses all 4: 2 * (1/16) = 0.125
    assert paired_with_dense(lost, dense) == "0 / 4, p 0.12"
    assert paired_with_dense(dense, dense) == "-"
    assert paired_with_dense({"passkey_acc": 0.5}, dense) == "-"  # a record from before per-case results
    assert paired_with_dense({"passkey_correct": [True]}, dense) == "-"  # not the same cases


@pytest.mark.parametrize("change", [{"passkey_cases": 0}, {"passkey_cases": (10, 0)}, {"prompts": ()},
                                    {"decode_batch": 0}, {"cont_len": 0}])
def test_a_preset_refuses_empty_counts_by_name(change: dict[str, object]) -> None:
    from condcomp.bench.kv_presets import PRESETS

    name = next(iter(change))
    with pytest.raises(ValueError, match=f"{name} must be one or more values >= 1"):
        replace(PRESETS["cpu"], **change)  # type: ignore[arg-type]


@pytest.mark.parametrize("names, timed, says", [
    (["dense", "bogus"], None, r"unknown kv variant\(s\) \['bogus'\]"),
    (["dense", "streaming"], ["streeming"], r"--time-decode names \['streeming'\], which this run does not measure"),
    (["dense"], ["streaming"], r"--time-decode names \['streaming'\]"),
])
def test_a_variant_or_timed_name_the_run_does_not_measure_is_refused_before_any_work(
        tmp_path: Path, names: list[str], timed: list[str] | None, says: str) -> None:
    """Red team round 5: --time-decode with a misspelt name timed nothing, without a word."""
    from condcomp.bench import kv

    with pytest.raises(ValueError, match=says):
        kv.run("tiny-llama", tmp_path, kv.PRESETS["quick"], names, threads=1, texts=TEXTS, timed=timed)
    assert not any(tmp_path.iterdir())
