"""The long-context cases of ``condcomp bench kv``, built from local text corpora only, deterministic from a seed.

- **Haystack**: documents of the staged corpora (``../shared/data``, the test splits), cleaned, shuffled by the
  seed, tokenized and concatenated into one token stream, separated by the tokenizer's document separator.
- **Continuation cases**: windows of ``prompt_len + cont_len + 1`` consecutive stream tokens at seeded offsets: the
  first ``prompt_len`` are the prompt (prefilled into the cache), the next ``cont_len`` are fed through the cache
  and the ``cont_len`` tokens after the prompt's first one are scored (each prediction reads the cache).
- **Passkey cases**: the classic passkey-retrieval prompt (an instruction, haystack text, a random 5-digit key
  planted at a relative depth, more haystack, the question), exactly ``prompt_len`` tokens; the answer is the
  greedy continuation, correct when its first number equals the key.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Encode = Callable[[str], list[int]]  # text -> token ids, no special tokens

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about it.\n\n")
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyFormat:
    """How a passkey prompt reads: ``head`` (before the haystack), ``needle`` (``{key}`` is the key) and ``tail``
    (after the haystack, ending where the answer starts)."""

    name: str
    head: str = INSTRUCTION
    needle: str = NEEDLE
    tail: str = QUESTION


RAW = PasskeyFormat("raw")
# A copy task: the prompt ends with the needle's opening words, a name found nowhere else, and the needle says its
# line three times, so a model that copies what followed those words earlier (an induction head) answers with the
# key. No question: asked "What is the pass key?", SmolLM2-135M defines the words instead (results/kv/README.md).
COPY = PasskeyFormat("copy", needle="\n\n" + " ".join(["The pass key of Zorblat Quixen is {key}."] * 3) + "\n\n",
                     tail="\n\nThe pass key of Zorblat Quixen is")


def chat_format(render: Callable[[str], str], name: str = "chat", needle: str = NEEDLE,
                question: str = "What is the pass key?", primer: str = "The pass key is") -> PasskeyFormat:
    """The passkey prompt as an instruct model's chat: instruction, haystack and question in the user turn, the
    assistant's answer primed with ``primer``. ``render(user_text)``: the chat template applied to one user message
    with the assistant turn opened (``tokenizer.apply_chat_template(..., add_generation_prompt=True)``)."""
    marker = "\u0000HAYSTACK\u0000"
    before, after = render(INSTRUCTION + marker + "\n\n" + question).split(marker)
    return PasskeyFormat(name, head=before, needle=needle, tail=after + primer)


DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class PasskeyCase:
    """One passkey prompt: ``ids`` (exactly the prompt length), the key, the requested relative depth, and where
    the needle's tokens start and end in ``ids``."""

    ids: list[int]
    key: str
    depth: float
    needle_start: int
    needle_end: int


def haystack_stream(texts: Sequence[str], encode: Encode, sep_id: int, min_tokens: int) -> list[int]:
    """The texts' tokens, each followed by ``sep_id``, until at least ``min_tokens`` tokens (all texts if fewer).

    >>> haystack_stream(["a b", "c"], lambda t: [len(w) for w in t.split()], 0, 3)
    [1, 1, 0]
    """
    stream: list[int] = []
    for text in texts:
        if len(stream) >= min_tokens:
            break
        stream.extend(encode(text))
        stream.append(sep_id)
    return stream


def corpus_texts(data_dir: Path, datasets: Sequence[str], seed: int) -> list[str]:
    """The test-split documents of the named staged datasets, interleaved, in a seeded order."""
    from condcomp.experiments.llm.data import dataset_documents

    per = [dataset_documents(name, data_dir, "test", seed) for name in datasets]
    return [doc for group in zip(*per) for doc in group]


def _offsets(stream_len: int, window: int, n: int, rng: random.Random) -> list[int]:
    if stream_len < window:
        raise ValueError(f"the haystack holds {stream_len} tokens, fewer than one case's {window}: add documents "
                         "(more --datasets) or shorten the prompt")
    return [rng.randrange(0, stream_len - window + 1) for _ in range(n)]


def continuation_cases(stream: Sequence[int], prompt_len: int, cont_len: int, n: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``prompt_len + cont_len + 1`` stream tokens at offsets drawn from ``seed`` and the lengths."""
    rng = random.Random(f"continuation/{seed}/{prompt_len}/{cont_len}")
    window = prompt_len + cont_len + 1
    return [list(stream[o:o + window]) for o in _offsets(len(stream), window, n, rng)]


def passkey_cases(stream: Sequence[int], encode: Encode, prompt_len: int, n: int, seed: int,
                  depths: Sequence[float] = DEPTHS, prefix_ids: Sequence[int] = (), fmt: PasskeyFormat = RAW
                  ) -> list[PasskeyCase]:
    """``n`` passkey prompts of exactly ``prompt_len`` tokens; case i asks for depth ``depths[i % len(depths)]``.

    The needle goes after ``round(depth * H)`` haystack tokens (H: the haystack tokens in the prompt), so its
    start sits at that fraction of the way through the haystack; keys are uniform over 10000..99999.
    ``prefix_ids`` (e.g. a BOS token) open every prompt.
    """
    rng = random.Random(f"passkey/{seed}/{prompt_len}")
    head = list(prefix_ids) + encode(fmt.head)
    question = encode(fmt.tail)
    cases = []
    for i in range(n):
        key = str(rng.randint(10000, 99999))
        depth = float(depths[i % len(depths)])
        needle = encode(fmt.needle.format(key=key))
        H = prompt_len - len(head) - len(needle) - len(question)
        if H < 1:
            raise ValueError(f"a passkey prompt of {prompt_len} tokens leaves no room for haystack text "
                             f"(instruction, needle and question take {prompt_len - H}); use a longer prompt")
        (offset,) = _offsets(len(stream), H, 1, rng)
        hay = list(stream[offset:offset + H])
        cut = round(depth * H)
        start = len(head) + cut
        ids = head + hay[:cut] + needle + hay[cut:] + question
        cases.append(PasskeyCase(ids, key, depth, start, start + len(needle)))
    return cases


def answer_correct(answer: str, key: str) -> bool:
    """Exact match: the answer's first number (digits only) is the key.

    >>> answer_correct(" 41729. Remember", "41729"), answer_correct(" 417290", "41729"), answer_correct("no", "1")
    (True, False, False)
    """
    found = re.search(r"\d+", answer)
    return found is not None and found.group() == key
