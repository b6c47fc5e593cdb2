"""``bench kv``'s facts task: facts planted at distinct depths, the question after the context through the real
cache path, and the text sources a clone runs with (the built-in corpus, a file, a folder, a HF dataset name)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from condcomp.bench.kv_cases import FACTS_HEAD, facts_cases, haystack_stream

TEXTS = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(60))
         for i in range(40)]
FACT_RE = re.compile(r"The pass key of ([A-Z][a-z]+ [A-Z][a-z]+) is (\d{4})\.")


def greedy_without_cache(model: Any, ids: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids``, each from a whole forward with no cache: the reference a cached
    answer is checked against."""
    seq, answer = torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
            answer.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], 1)
    return answer


def byte_encode(text: str) -> list[int]:
    return list(text.encode())


def stream() -> list[int]:
    return haystack_stream(TEXTS, byte_encode, 10, min_tokens=8000)


@pytest.mark.parametrize("in_context", [False, True])
def test_facts_are_planted_at_distinct_depths_and_one_is_asked(in_context: bool) -> None:
    cases = facts_cases(stream(), byte_encode, 900, n=8, seed=1, n_facts=4, in_context=in_context,
                        question_form="qa")
    asked_slices = []
    for case in cases:
        assert len(case.ids) == 900
        text = bytes(case.ids).decode()
        question = bytes(case.question).decode()
        if in_context:  # the question ends the context
            after = facts_cases(stream(), byte_encode, 900, n=8, seed=1, question_form="qa")[cases.index(case)]
            question = text[-len(bytes(after.question).decode()):]
        context = text[:len(text) - len(question)] if in_context else text
        facts = FACT_RE.findall(context)
        assert context.startswith(FACTS_HEAD) and len(facts) == 4
        assert len({n.split()[0] for n, _ in facts}) == 4 and len({n.split()[1] for n, _ in facts}) == 4
        assert len({k for _, k in facts}) == 4  # distinct names (first and last) and keys
        starts = [context.index(f"The pass key of {n} is") - 2 for n, _ in facts]  # "\n\n" opens each fact
        assert list(case.fact_starts) == starts and starts == sorted(starts)
        (example_name, example_key), = FACT_RE.findall(question)  # the example: one other fact, with its key
        asked = question.rsplit("The pass key of ", 1)[1].removesuffix(" is")
        assert question.endswith(f"The pass key of {asked} is") and asked != example_name
        assert (example_name, example_key) in facts
        assert dict(facts)[asked] == case.key  # the asked key is the asked name's
        asked_slices.append([n for n, _ in facts].index(asked))
        assert (case.question == []) == in_context
    assert asked_slices == [0, 1, 2, 3, 0, 1, 2, 3]  # every depth slice asked equally often
    assert len({len(c.question) for c in cases}) == 1  # one question length: a batch steps it at once
    depths = [c.depth for c in cases]
    assert all(0.05 + 0.225 * (i % 4) <= d <= 0.05 + 0.225 * (i % 4 + 1) for i, d in enumerate(depths))
    assert facts_cases(stream(), byte_encode, 900, n=8, seed=1, in_context=in_context, question_form="qa") == cases


def test_facts_refuse_a_context_too_short() -> None:
    with pytest.raises(ValueError, match="leaves no room for haystack text"):
        facts_cases(stream(), byte_encode, 100, n=1, seed=0)
    with pytest.raises(ValueError, match="at least 2 fact"):
        facts_cases(stream(), byte_encode, 900, n=1, seed=0, n_facts=1, question_form="qa")


def gqa_llama(transformers: Any, seed: int) -> torch.nn.Module:
    """A random 2-layer Llama with 6 query heads over 3 KV groups and a 300-token vocabulary (byte ids)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=3, vocab_size=300,
                                      max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).eval()


def test_the_question_after_the_context_reads_the_prefilled_cache() -> None:
    """The dense variant's answer (context prefilled into the cache, question and answer fed through it) equals a
    greedy decode of context + question by the plain model without any cache: the float64 reference."""
    transformers = pytest.importorskip("transformers")
    from condcomp.bench import kv
    from condcomp.bench.kv_presets import PRESETS, ByteTokenizer

    model = gqa_llama(transformers, seed=0)
    bench = kv.Bench(model, torch.device("cpu"), importance=lambda: None)
    cases = facts_cases(stream(), byte_encode, 400, n=2, seed=0, question_form="qa")
    preset = replace(PRESETS["quick"], batch=2, answer_tokens=3)
    res = kv.measure_length(bench, ["dense"], [], cases, preset, ByteTokenizer().decode, _NoBar())
    reference = model.to(torch.float64)
    for case, sample in zip(cases, res["dense"]["samples"]):
        assert sample["answer"] == ByteTokenizer().decode(greedy_without_cache(reference, case.ids + case.question, 3))


class _NoBar:
    def update(self, n: int) -> None:
        pass


def test_text_sources(tmp_path: Path) -> None:
    from condcomp.bench.kv_text import builtin_texts, choose_texts, dir_texts, file_texts, parse_hf_spec

    text = tmp_path / "a.txt"
    text.write_text("First  document\nline two.\n\n\nSecond one.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "third"}) + "\n\n" + json.dumps({"text": "fourth"}) + "\n")
    assert file_texts(text) == ["First document line two.", "Second one."]
    assert dir_texts(tmp_path) == ["First document line two.", "Second one.", "third", "fourth"]
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="c.jsonl:1: no string field 'text'"):
        file_texts(tmp_path / "c.jsonl")
    with pytest.raises(FileNotFoundError, match="--text-file"):
        file_texts(tmp_path / "missing.txt")
    shipped = builtin_texts(seed=0, rounds=2)
    assert len(shipped) == 28 and sorted(shipped[:14]) == sorted(shipped[14:]) and shipped[:14] != shipped[14:]
    assert choose_texts(text_file=text) == (file_texts(text), "file:a.txt")
    assert choose_texts(builtin=True, seed=0)[1] == "builtin"
    with pytest.raises(ValueError, match="--text-file and --builtin-text: give one text source"):
        choose_texts(text_file=text, builtin=True)
    assert parse_hf_spec("imdb::label") == ("imdb", "train", "label")
    with pytest.raises(ValueError, match="expected NAME"):
        parse_hf_spec("a:b:c:d")


def test_hf_dataset_without_the_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.bench.kv_text import hf_texts

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        hf_texts("imdb:test")


def test_a_missing_data_dir_names_bench_kv_flags(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from condcomp.bench import kv

    preset = replace(kv.PRESETS["quick"], prompts=(300,))
    with pytest.raises(FileNotFoundError, match="--text-file PATH, --text-dir DIR or --hf-dataset") as err:
        kv.run("tiny-llama", tmp_path, preset, ["dense"], threads=1, data_dir=str(tmp_path / "none"), timed=[])
    assert "--train-file" not in str(err.value)


def test_quick_run_from_a_clone_without_shared_data(tmp_path: Path) -> None:
    """``condcomp bench kv --model tiny-llama --preset quick`` in a folder with no ../shared/data: the built-in
    corpus, rc 0, the records written."""
    pytest.importorskip("transformers")
    work = tmp_path / "clone"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CONDCOMP_DATA_DIR"}
    done = subprocess.run([sys.executable, "-m", "condcomp.cli", "bench", "kv", "--model", "tiny-llama", "--preset",
                           "quick", "--out", str(tmp_path / "out"), "--threads", "1", "--variants", "dense",
                           "quantized-fp8", "--time-decode"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the built-in corpus" in done.stdout
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert {r["variant"] for r in metrics["records"]} == {"dense", "quantized-fp8"}
    record = json.loads((tmp_path / "out" / "records" / "dense@320.json").read_text())
    assert record["settings"]["text"] == "builtin" and record["task"] == "facts"
    assert record["settings"]["question_form"] == "completion" and record["settings"]["haystack_sep"] == "blank"


@pytest.mark.parametrize("n_facts", [1, 3])
@pytest.mark.parametrize("in_context", [False, True])
def test_completion_question_is_the_asked_facts_opening_words(n_facts: int, in_context: bool) -> None:
    """``--question-form completion``: the question is exactly "\\n\\nThe pass key of <asked name> is" (no example,
    no Question/Answer), after the context or ending it; one fact per context is allowed."""
    cases = facts_cases(stream(), byte_encode, 700, n=6, seed=2, n_facts=n_facts, in_context=in_context,
                        question_form="completion")
    for case in cases:
        assert len(case.ids) == 700
        text = bytes(case.ids).decode()
        question = text[text.rindex("\n\nThe pass key of "):] if in_context else bytes(case.question).decode()
        facts = FACT_RE.findall(text)
        assert len(facts) == n_facts
        asked = dict(facts)
        (name,) = [n for n in asked if question == f"\n\nThe pass key of {n} is"]  # the exact text, one name
        assert asked[name] == case.key and "Question" not in question and "Answer" not in question
        assert (case.question == []) == in_context
    assert len({len(c.question) for c in cases}) == 1


def test_question_forms_are_checked_by_name() -> None:
    from condcomp.bench.kv_presets import PRESETS

    with pytest.raises(ValueError, match="unknown facts question form 'cloze'"):
        facts_cases(stream(), byte_encode, 900, n=1, seed=0, question_form="cloze")
    with pytest.raises(ValueError, match="needs --facts 2 or more"):
        replace(PRESETS["quick"], facts=1, question_form="qa")
    with pytest.raises(ValueError, match="--question-form"):
        replace(PRESETS["quick"], question_form="cloze")


def test_completion_question_is_fed_through_the_cache_after_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step after the prefill feeds the completion question's tokens on a cache holding the whole
    context; the answer equals a float64 greedy decode of context + question with no cache (the reference)."""
    transformers = pytest.importorskip("transformers")
    from condcomp.bench import kv
    from condcomp.bench.kv_presets import PRESETS, ByteTokenizer

    model = gqa_llama(transformers, seed=1)
    bench = kv.Bench(model, torch.device("cpu"), importance=lambda: None)
    cases = facts_cases(stream(), byte_encode, 400, n=2, seed=0, n_facts=1, question_form="completion")
    fed: list[tuple[list[list[int]], int]] = []
    step = bench.step

    def recording_step(variant: str, ids: torch.Tensor, cache: object) -> object:
        fed.append((ids.tolist(), cache.get_seq_length()))  # type: ignore[attr-defined]
        return step(variant, ids, cache)

    monkeypatch.setattr(bench, "step", recording_step)
    preset = replace(PRESETS["quick"], batch=2, answer_tokens=3, facts=1, question_form="completion")
    res = kv.measure_length(bench, ["dense"], [], cases, preset, ByteTokenizer().decode, _NoBar())
    first_ids, cached = fed[0]
    assert cached == 400  # the whole context in the cache, the question not in it
    assert [bytes(row).decode() for row in first_ids] == [bytes(c.question).decode() for c in cases]
    assert all(bytes(c.question).decode().startswith("\n\nThe pass key of ") for c in cases)
    reference = model.to(torch.float64)
    for case, sample in zip(cases, res["dense"]["samples"]):
        assert sample["answer"] == ByteTokenizer().decode(greedy_without_cache(reference, case.ids + case.question, 3))


def test_haystack_separator_is_a_blank_line_for_facts_and_eos_for_passkey() -> None:
    """The facts task joins documents with a blank line (SmolLM2 stops recalling facts before an <|endoftext|>);
    the passkey task keeps the tokenizer's separator and records no new setting, so its old records read back."""
    from condcomp.bench.kv_presets import PRESETS, ByteTokenizer, separator_ids

    tok = ByteTokenizer()
    facts, passkey = PRESETS["quick"], replace(PRESETS["quick"], task="passkey")
    assert separator_ids(facts, tok.sep_id, tok) == [10, 10]  # "\n\n" in bytes
    assert separator_ids(passkey, tok.sep_id, tok) == [256]
    assert separator_ids(replace(facts, haystack_sep="eos"), tok.sep_id, tok) == [256]
    assert passkey.task_settings() == {}
    assert replace(passkey, haystack_sep="blank").task_settings() == {"haystack_sep": "blank"}
    assert facts.task_settings() == {"task": "facts", "facts": facts.facts, "question_in_context": False,
                                     "question_form": "completion", "haystack_sep": "blank"}
    with pytest.raises(ValueError, match="--haystack-sep"):
        replace(facts, haystack_sep="tab")


def test_a_shorter_run_answers_the_first_cases_of_a_longer_one() -> None:
    """A 20-case screen answers the first 20 cases of the 100-case run (the cases are drawn one after the other
    from one generator), so its records pair with the longer run's first 20."""
    long = facts_cases(stream(), byte_encode, 600, n=100, seed=0, n_facts=4)
    short = facts_cases(stream(), byte_encode, 600, n=20, seed=0, n_facts=4)
    assert short == long[:20]
