"""The quotes task of ``condcomp bench kv``: recall a span of the context's own text, word for word.

The facts task plants made-up sentences with 4-digit keys; this one plants nothing. The context is exactly
``prompt_len`` tokens of the haystack (real documents); a passage of it at a drawn depth is quoted after the
compressed context (``"\\n\\n"`` and the passage's first :data:`CUE_TOKENS` tokens, fed through the cache), and the
model continues it greedily. A case is found when the answer's first :data:`ANSWER_WORDS` words are the words that
follow the quoted tokens in the context (case and punctuation ignored). Answers are words, not numbers; the text is
whatever the haystack holds (``--corpora``, ``--text-file``, ...), so the task can be moved to another domain.

A passage is drawn only where the quote and its answer stay inside one document (no separator token in them), the
:data:`ANSWER_SPAN` tokens after the quote hold :data:`ANSWER_WORDS` whole words, and the quoted tokens occur once in
the context (a quote seen twice has two right answers). Depths: case i draws its passage in the ``i % 5``-th of
five equal slices of [0.05, 0.95] of the context, so every depth slice is asked equally often.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from condcomp.bench.kv_cases import Encode, PasskeyFormat, RetrievalCase, answer_correct, draw_offsets, retrieval_cases

Decode = Callable[[list[int]], str]

CUE_TOKENS = 16  # the quoted tokens: long enough to name one place in a 1024-token context
ANSWER_WORDS = 3  # the words of the context's own continuation a found answer reproduces
ANSWER_SPAN = 8  # tokens after the quote that must hold those words (bench kv generates 8 answer tokens)
SLICES = 5


def answer_words(text: str, n: int = ANSWER_WORDS) -> list[str]:
    """The first ``n`` words of ``text``, lower-cased, punctuation dropped.

    >>> answer_words(" Tower, built in 1889 by")
    ['tower', 'built', 'in']
    """
    return re.findall(r"\w+", text.lower())[:n]


def whole_words(text: str, n: int = ANSWER_WORDS) -> bool:
    """Whether ``text`` holds ``n`` whole words: the ``n``-th ends before the text does (not cut by the span's end).

    >>> whole_words(" Tower, built in 1889"), whole_words(" Tower, built in"), whole_words(" Tower, built in.")
    (True, False, True)
    """
    words = list(re.finditer(r"\w+", text))
    return len(words) > n or (len(words) == n and words[-1].end() < len(text))


def quote_correct(answer: str, expected: str) -> bool:
    """Whether ``answer``'s first :data:`ANSWER_WORDS` words are ``expected``'s.

    >>> quote_correct(" tower built in Paris", "Tower, built in 1889"), quote_correct(" tower was", "tower built in")
    (True, False)
    """
    want = answer_words(expected)
    return len(want) == ANSWER_WORDS and answer_words(answer) == want


def _occurrences(ids: Sequence[int], part: Sequence[int]) -> int:
    n = len(part)
    return sum(1 for i in range(len(ids) - n + 1) if list(ids[i:i + n]) == list(part))


def quote_cases(stream: Sequence[int], encode: Encode, decode: Decode, prompt_len: int, n: int, seed: int,
                sep_ids: Sequence[int]) -> list[RetrievalCase]:
    """``n`` quote cases of exactly ``prompt_len`` tokens each (see the module docstring); ``sep_ids``: the token
    ids between two haystack documents, which a quote and its answer may not contain."""
    if prompt_len < 4 * (CUE_TOKENS + ANSWER_SPAN):
        raise ValueError(f"the quotes task needs prompts of at least {4 * (CUE_TOKENS + ANSWER_SPAN)} tokens to hold "
                         f"a quote of {CUE_TOKENS} tokens and its answer away from the ends, got {prompt_len}")
    rng = random.Random(f"quotes/{seed}/{prompt_len}")
    lead = encode("\n\n")
    sep = set(sep_ids)
    width = 0.9 / SLICES
    span = CUE_TOKENS + ANSWER_SPAN
    cases: list[RetrievalCase] = []
    for i in range(n):
        for _ in range(200):
            (offset,) = draw_offsets(len(stream), prompt_len, 1, rng)
            ids = list(stream[offset:offset + prompt_len])
            depth = 0.05 + width * (i % SLICES + rng.random())
            start = min(round(depth * prompt_len), prompt_len - span)
            cue, after = ids[start:start + CUE_TOKENS], ids[start + CUE_TOKENS:start + span]
            expected = decode(after)
            if sep.isdisjoint(cue + after) and whole_words(expected) and (
                    _occurrences(ids, cue) == 1):
                break
        else:
            raise ValueError("no quote inside one document in 200 draws: the haystack's documents are shorter than "
                             f"a quote and its answer ({span} tokens); use longer documents (other --corpora or "
                             "--text-file)")
        cases.append(RetrievalCase(ids, lead + cue, " ".join(answer_words(expected)), start / prompt_len, (start,)))
    return cases


def task_cases(task: str, stream: Sequence[int], encode: Encode, decode: Decode, prompt_len: int, n: int, seed: int,
               prefix_ids: Sequence[int], fmt: PasskeyFormat | None, sep_ids: Sequence[int], n_facts: int = 4,
               in_context: bool = False, question_form: str = "completion", question_aware: bool = False
               ) -> list[RetrievalCase]:
    """The retrieval cases of any ``bench kv`` task: the quotes task's here, the others'
    :func:`~condcomp.bench.kv_cases.retrieval_cases`."""
    if task == "quotes":
        return quote_cases(stream, encode, decode, prompt_len, n, seed, sep_ids)
    return retrieval_cases(task, stream, encode, prompt_len, n, seed, prefix_ids, fmt, n_facts, in_context,
                           question_form, question_aware)


def answer_check(task: str) -> Callable[[str, str], bool]:
    """How a greedy answer is scored against a case's ``key``: its first number (facts, passkey:
    :func:`~condcomp.bench.kv_cases.answer_correct`) or its first words (quotes: :func:`quote_correct`)."""
    return quote_correct if task == "quotes" else answer_correct


__all__ = ["ANSWER_WORDS", "CUE_TOKENS", "answer_check", "answer_words", "quote_cases", "quote_correct", "task_cases",
           "whole_words"]
