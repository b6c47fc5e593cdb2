"""``bench kv --task quotes``: a passage of the context's own text quoted after it, the words that follow it the
answer. Cases are checked against the original documents (the words after the quoted text, found by string search
in the text the haystack was built from), and one run goes through the real cache path on the tiny Llama."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from condcomp.bench.kv_cases import answer_correct, haystack_stream
from condcomp.bench.kv_quotes import ANSWER_WORDS, CUE_TOKENS, answer_check, quote_cases, quote_correct, task_cases
from condcomp.bench.kv_text import choose_texts

SEP = 256  # the byte tokenizer's document separator
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# documents of short random words: 16 bytes of one name one place, and 8 bytes hold at least 3 words
TEXTS = [" ".join("".join(random.Random(f"{d}/{w}").choices(LETTERS, k=random.Random(w).randint(1, 3)))
                  for w in range(120)) for d in range(30)]


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode()


def stream() -> list[int]:
    return haystack_stream(TEXTS, encode, SEP, min_tokens=20_000)


def test_each_quote_is_a_passage_of_one_document_and_its_key_the_words_that_follow() -> None:
    cases = quote_cases(stream(), encode, decode, 600, n=10, seed=1, sep_ids=[SEP])
    slices = []
    for case in cases:
        assert len(case.ids) == 600
        assert case.question[:2] == list(b"\n\n") and len(case.question) == 2 + CUE_TOKENS
        quote = decode(case.question[2:])
        start = case.fact_starts[0]
        assert decode(case.ids[start:start + CUE_TOKENS]) == quote
        assert decode(case.ids).count(quote) == 1  # one place in the context
        docs = [d for d in TEXTS if quote in d]
        assert len(docs) >= 1  # inside one document: no separator crossed
        after = docs[0].split(quote, 1)[1]
        assert case.key.split() == re.findall(r"[a-z]+", after)[:ANSWER_WORDS]
        assert case.depth == start / 600
        slices.append(min(int((case.depth - 0.05) / 0.18), 4))
    assert slices == [0, 1, 2, 3, 4] * 2  # every depth slice asked equally often


def test_the_same_seed_draws_the_same_cases_and_a_longer_run_extends_a_shorter_one() -> None:
    short = quote_cases(stream(), encode, decode, 600, n=4, seed=2, sep_ids=[SEP])
    long = quote_cases(stream(), encode, decode, 600, n=8, seed=2, sep_ids=[SEP])
    assert [c.ids for c in long[:4]] == [c.ids for c in short]  # screens of fewer cases are the first cases


def test_answers_are_scored_on_their_first_words() -> None:
    assert quote_correct(" Eiffel tower, built", "eiffel tower built")
    assert not quote_correct(" Eiffel tower", "eiffel tower built")  # too few words
    assert not quote_correct(" eiffel built tower", "eiffel tower built")
    assert answer_check("quotes") is quote_correct and answer_check("facts") is answer_correct


def test_refusals_name_what_to_change() -> None:
    with pytest.raises(ValueError, match="at least 96 tokens"):
        quote_cases(stream(), encode, decode, 64, n=1, seed=0, sep_ids=[SEP])
    tiny_docs = haystack_stream(["ab cd"] * 4000, encode, SEP, min_tokens=20_000)  # every quote crosses documents
    with pytest.raises(ValueError, match="longer documents"):
        quote_cases(tiny_docs, encode, decode, 600, n=1, seed=0, sep_ids=[SEP])
    with pytest.raises(ValueError, match="unknown retrieval task"):
        task_cases("quote", stream(), encode, decode, 600, 1, 0, [], None, [SEP])
    assert task_cases("quotes", stream(), encode, decode, 600, 2, 0, [], None, [SEP]) == quote_cases(
        stream(), encode, decode, 600, n=2, seed=0, sep_ids=[SEP])
    with pytest.raises(ValueError, match="not a staged corpus"):
        choose_texts(corpora=("wikipedia",))
    with pytest.raises(ValueError, match="give one text source"):
        choose_texts(text_file=Path("a.txt"), corpora=("snli",))


def test_quick_run_scores_quotes_through_the_cache(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from condcomp.cli import main

    assert main(["bench", "kv", "--model", "tiny-llama", "--preset", "quick", "--task", "quotes", "--builtin-text",
                 "--out", str(tmp_path), "--threads", "1", "--variants", "dense", "streaming"]) == 0
    record = json.loads((tmp_path / "records" / "dense@320.json").read_text())
    assert record["task"] == "quotes" and record["settings"]["cue_tokens"] == CUE_TOKENS
    assert record["settings"]["answer_words"] == ANSWER_WORDS and record["settings"]["haystack_sep"] == "blank"
    assert len(record["retrieval_correct"]) == record["retrieval_n"] == 2
    assert "16 tokens of the context quoted" in (tmp_path / "summary.md").read_text()
    for sample in record["samples"]:  # the key is words, scored by their first words
        assert sample["correct"] == quote_correct(sample["answer"], sample["key"])
    refused = main(["bench", "kv", "--model", "tiny-llama", "--preset", "quick", "--task", "quotes", "--facts", "2",
                    "--builtin-text", "--out", str(tmp_path / "b"), "--threads", "1"])
    assert refused != 0 and not (tmp_path / "b" / "records").exists()  # --facts is the facts task's
