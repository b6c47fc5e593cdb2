"""``calibrate-kv --mix``'s calibration rows, checked by construction against independent string searches: each
kind of row holds what it says where it says (a fact's digits stated earlier and answered at the end, a quoted
passage found earlier in the row's own text, plain text a slice of the stream), no wording or name is bench kv's,
and no test-split document reaches a row."""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

import pytest

from condcomp.bench.kv_cases import COMPLETION_FORMAT, FACT, FIRST_NAMES, LAST_NAMES, NEEDLE, QUESTION_FORMAT
from condcomp.bench.kv_presets import ByteTokenizer
from condcomp.bench.kv_quotes import CUE_TOKENS
from condcomp.experiments.llm.kv_mixture import (
    CITIES,
    CONTINUATION,
    CUE_LENGTHS,
    HELD_OUT_DOCS,
    KINDS,
    NAMES,
    WORDINGS,
    mixture_rows,
    mixture_texts,
)

TOK = ByteTokenizer()
SEP = ByteTokenizer.sep_id
WORDS = ["river", "stone", "lamp", "cloud", "garden", "violin", "copper", "meadow", "harbor", "lantern", "orchid"]


def _docs(rng: random.Random, n: int, marker: str) -> list[str]:
    return [f"{marker}{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 40))) for i in range(n)]


def _stream(texts: list[str]) -> list[int]:
    out: list[int] = []
    for t in texts:
        out += TOK.encode(t) + [SEP]
    return out


def _occurs(ids: list[int], part: list[int]) -> int:
    return sum(1 for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part)


@pytest.fixture(scope="module")
def rows() -> tuple[list[int], list]:
    stream = _stream(_docs(random.Random(0), 400, "doc"))
    return stream, mixture_rows(stream, TOK.encode, TOK.decode, 700, 12, seed=3, sep_ids=[SEP])


def test_rows_are_the_three_kinds_in_turn_each_exactly_seq_len(rows: tuple[list[int], list]) -> None:
    _, rs = rows
    assert [r.kind for r in rs] == [KINDS[i % 3] for i in range(12)]
    assert all(len(r.ids) == 700 for r in rs)


def test_a_facts_row_states_the_asked_fact_earlier_and_answers_it_at_the_end(rows: tuple[list[int], list]) -> None:
    _, rs = rows
    for r in (r for r in rs if r.kind == "facts"):
        a, b = r.answer
        assert b == len(r.ids) and TOK.decode(r.ids[a:b]) == f" {r.key}" and r.key.isdigit()
        text = TOK.decode(r.ids[:a])
        # the question, in some wording's words, just before the answer; its subject's fact stated earlier
        asked = [(w, s) for w in WORDINGS for s in NAMES + CITIES if text.endswith("\n\n" + w.question.format(who=s))]
        assert len(asked) == 1
        wording, subject = asked[0]
        statement = wording.statement.format(who=subject, digits=r.key)
        question = "\n\n" + wording.question.format(who=subject)
        assert text.count(statement) == 1 and text.index(statement) + len(statement) <= len(text) - len(question)
        stated = re.findall(re.escape(wording.statement).replace(r"\{who\}", "(.+?)").replace(r"\{digits\}", r"(\d+)"),
                            text)
        assert 2 <= len(stated) <= 5 and len({s for s, _ in stated}) == len(stated)  # distinct subjects


def test_a_quote_row_continues_a_passage_of_its_own_text(rows: tuple[list[int], list]) -> None:
    _, rs = rows
    lead = TOK.encode("\n\n")
    for r in (r for r in rs if r.kind == "quote"):
        a, b = r.answer
        assert len(r.ids) - a == CONTINUATION and TOK.decode(r.ids[a:b]) == r.key
        found = []
        for c in CUE_LENGTHS:
            passage = r.ids[a - c:]  # the cue and its continuation
            context = r.ids[:a - c - len(lead)]
            if r.ids[a - c - len(lead):a - c] == lead and _occurs(context, passage) == 1 and \
                    _occurs(context, r.ids[a - c:a]) == 1 and SEP not in passage:
                found.append(c)
        assert found and CUE_TOKENS not in found  # never the quotes task's cue length


def test_a_plain_row_is_a_slice_of_the_stream(rows: tuple[list[int], list]) -> None:
    stream, rs = rows
    for r in (r for r in rs if r.kind == "plain"):
        assert r.answer is None and r.key == "" and _occurs(stream, r.ids) >= 1


def test_rows_are_deterministic_from_the_seed_and_extend(rows: tuple[list[int], list]) -> None:
    stream, rs = rows
    again = mixture_rows(stream, TOK.encode, TOK.decode, 700, 5, seed=3, sep_ids=[SEP])
    assert [r.ids for r in again] == [r.ids for r in rs[:5]]
    other = mixture_rows(stream, TOK.encode, TOK.decode, 700, 5, seed=4, sep_ids=[SEP])
    assert all(x.ids != y.ids for x, y in zip(other, again))


def test_no_wording_or_name_is_bench_kvs() -> None:
    bench_words = {w for n in FIRST_NAMES + LAST_NAMES for w in n.split()}
    assert not bench_words & {w for n in NAMES for w in n.split()}
    for w in WORDINGS:
        for template in (w.statement, w.question):
            assert "pass key" not in template.lower() and "passkey" not in template.lower()
    bench = [FACT, QUESTION_FORMAT, COMPLETION_FORMAT, NEEDLE]
    assert not {w.statement for w in WORDINGS} & set(bench) and not {w.question for w in WORDINGS} & set(bench)


def test_rows_too_short_for_a_quote_are_refused() -> None:
    with pytest.raises(ValueError, match="--seq-len of at least 224"):
        mixture_rows(list(range(5000)), TOK.encode, TOK.decode, 200, 3, seed=0, sep_ids=[SEP])


def _write(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "label": 0}) + "\n")


def test_the_mixture_reads_the_train_split_only_and_holds_the_screens_documents_apart(tmp_path: Path) -> None:
    rng = random.Random(1)
    shared = "shared document " + " ".join(WORDS)  # in both splits: left out
    for name in ("ag_news", "yelp"):
        _write(tmp_path / name / "train.jsonl.gz", _docs(rng, 2 * HELD_OUT_DOCS + 50, f"{name}train") + [shared])
        _write(tmp_path / name / "test.jsonl.gz", _docs(rng, 30, f"{name}test") + [shared])
    train = mixture_texts(tmp_path, ("ag_news", "yelp"), seed=1000)
    held = mixture_texts(tmp_path, ("ag_news", "yelp"), seed=2000, held_out=True)
    assert len(held) == 2 * HELD_OUT_DOCS and len(train) == 2 * (HELD_OUT_DOCS + 50)
    assert not set(train) & set(held)
    assert all("train" in t.split()[0] for t in train + held)  # no test document, not the shared one
    assert [t.split()[0][:3] for t in train[:4]] == ["ag_", "yel", "ag_", "yel"]  # corpora interleaved
    assert mixture_texts(tmp_path, ("ag_news", "yelp"), seed=1000) == train
    rs = mixture_rows(_stream(train), TOK.encode, TOK.decode, 700, 9, seed=1000, sep_ids=[SEP])
    assert all("test" not in TOK.decode(r.ids) and "shared document" not in TOK.decode(r.ids) for r in rs)


def test_too_few_train_documents_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "yelp" / "train.jsonl.gz", _docs(random.Random(2), 2 * HELD_OUT_DOCS, "t"))
    _write(tmp_path / "yelp" / "test.jsonl.gz", _docs(random.Random(3), 5, "s"))
    with pytest.raises(ValueError, match="yelp's train split holds 1000 documents"):
        mixture_texts(tmp_path, ("yelp",), seed=0)
