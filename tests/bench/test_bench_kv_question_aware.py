"""``bench kv --question-aware``: the question-agnostic case's context followed by its question but the last token
is compressed, that token fed after it through the cache; recorded in the settings and the summary's first line;
refused with the tasks that ask no question after the context, and with ``--question-in-context``."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from condcomp.bench.kv_cases import facts_cases
from condcomp.bench.kv_presets import PRESETS, ByteTokenizer, refuse_other_task_options

sys.path.insert(0, str(Path(__file__).parent))
from test_bench_kv_facts import _NoBar, byte_encode, gqa_llama, greedy_without_cache, stream  # noqa: E402


@pytest.mark.parametrize("form", ["completion", "qa"])
def test_the_aware_case_is_the_agnostic_text_with_only_the_questions_last_token_after_the_cut(form: str) -> None:
    agnostic = facts_cases(stream(), byte_encode, 400, n=5, seed=3, n_facts=2, question_form=form)
    aware = facts_cases(stream(), byte_encode, 400, n=5, seed=3, n_facts=2, question_form=form, question_aware=True)
    for a, q in zip(agnostic, aware):
        assert len(a.ids) == 400 and q.ids == a.ids + a.question[:-1]  # the same facts, depths and haystack
        assert q.question == a.question[-1:] and q.ids + q.question == a.ids + a.question  # the same text
        assert bytes(a.question).decode().endswith(" is") and len(a.question) > 10
        assert (q.key, q.depth, q.fact_starts) == (a.key, a.depth, a.fact_starts)


def test_question_in_context_and_question_aware_are_refused_together() -> None:
    with pytest.raises(ValueError, match="--question-in-context and --question-aware"):
        facts_cases(stream(), byte_encode, 400, n=1, seed=0, in_context=True, question_aware=True)
    with pytest.raises(ValueError, match="--question-in-context and --question-aware"):
        replace(PRESETS["quick"], question_in_context=True, question_aware=True)


@pytest.mark.parametrize("task", ["passkey", "quotes"])
def test_tasks_without_a_question_after_the_context_refuse_it(task: str) -> None:
    with pytest.raises(ValueError, match=rf"--question-aware: only the facts task reads it, and this run's task is "
                                         rf"{task}"):
        refuse_other_task_options(task, ["question_aware"])
    refuse_other_task_options("facts", ["question_aware"])


def test_the_mode_is_in_the_settings_and_the_summarys_first_line() -> None:
    from condcomp.bench.kv_report import summary

    agnostic, aware = PRESETS["quick"], replace(PRESETS["quick"], question_aware=True)
    assert "question_aware" not in agnostic.task_settings()  # the records written before the flag read back
    assert aware.task_settings()["question_aware"] is True
    from dataclasses import asdict

    result = {"preset": asdict(aware), "records": [], "device": "cpu", "threads": 1, "skipped": {}}
    lines = summary(result).splitlines()
    assert lines[0] == "# condcomp bench kv: question-aware"
    assert "the question question-aware: compressed with the context but its last token, fed after it" in lines[2]
    assert summary({**result, "preset": asdict(agnostic)}).splitlines()[0] == "# condcomp bench kv"


def test_the_answer_reads_the_cache_after_the_question_was_compressed_with_the_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step feeds the question's last token on a cache holding the context and the rest of the question;
    the answer equals a float64 greedy decode of context + question with no cache (the reference)."""
    transformers = pytest.importorskip("transformers")
    from condcomp.bench import kv

    model = gqa_llama(transformers, seed=2)
    bench = kv.Bench(model, torch.device("cpu"), importance=lambda: None)
    cases = facts_cases(stream(), byte_encode, 300, n=2, seed=1, n_facts=1, question_aware=True)
    fed: list[tuple[list[list[int]], int]] = []
    step = bench.step

    def recording_step(variant: str, ids: torch.Tensor, cache: object) -> object:
        fed.append((ids.tolist(), cache.get_seq_length()))  # type: ignore[attr-defined]
        return step(variant, ids, cache)

    monkeypatch.setattr(bench, "step", recording_step)
    preset = replace(PRESETS["quick"], batch=2, answer_tokens=3, facts=1, question_aware=True)
    res = kv.measure_length(bench, ["dense"], [], cases, preset, ByteTokenizer().decode, _NoBar())
    first_ids, cached = fed[0]
    Q = len(facts_cases(stream(), byte_encode, 300, n=1, seed=1, n_facts=1)[0].question)
    assert cached == 300 + Q - 1  # the context and the question but its last token in the cache
    assert first_ids == [c.question for c in cases] and all(len(c.question) == 1 for c in cases)
    reference = model.to(torch.float64)
    for case, sample in zip(cases, res["dense"]["samples"]):
        assert sample["answer"] == ByteTokenizer().decode(greedy_without_cache(reference, case.ids + case.question, 3))
