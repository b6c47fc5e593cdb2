"""The long-context cases of ``condcomp bench kv``, built from local text corpora only, deterministic from a seed.

- **Haystack**: documents of the staged corpora (``../shared/data``, the test splits), cleaned, shuffled by the
  seed, tokenized and concatenated into one token stream, separated by a blank line (the facts task) or the
  tokenizer's document separator (the passkey task; :meth:`condcomp.bench.kv_presets.Preset.separator`).
- **Continuation cases**: windows of ``prompt_len + cont_len + 1`` consecutive stream tokens at seeded offsets: the
  first ``prompt_len`` are the prompt (prefilled into the cache), the next ``cont_len`` are fed through the cache
  and the ``cont_len`` tokens after the prompt's first one are scored (each prediction reads the cache).
- **Passkey cases**: the classic passkey-retrieval prompt (an instruction, haystack text, a random 5-digit key
  planted at a relative depth, more haystack, the question), exactly ``prompt_len`` tokens; the answer is the
  greedy continuation, correct when its first number equals the key.
- **Facts cases** (:func:`facts_cases`): one or more facts "The pass key of <name> is <4 digits>." planted at
  distinct depths (one drawn in each equal slice of the haystack), one of them asked; the question is fed after
  the context (question-agnostic: the cache compresses the context before the question is known) or placed at its
  end (``in_context``). Its form (:data:`QUESTION_FORMS`): ``completion``, the fact's own opening words "The pass
  key of <name> is" for the model to complete, or ``qa``, a Question/Answer pair with another fact as an example.
  Correct when the answer's first number is the asked key.
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


def haystack_stream(texts: Sequence[str], encode: Encode, sep_id: int | Sequence[int], min_tokens: int
                    ) -> list[int]:
    """The texts' tokens, each followed by ``sep_id`` (one token id, or several: a blank line's), until at least
    ``min_tokens`` tokens (all texts if fewer).

    >>> haystack_stream(["a b", "c"], lambda t: [len(w) for w in t.split()], 0, 3)
    [1, 1, 0]
    >>> haystack_stream(["a b", "c"], lambda t: [len(w) for w in t.split()], [7, 7], 3)
    [1, 1, 7, 7]
    """
    sep = [sep_id] if isinstance(sep_id, int) else list(sep_id)
    stream: list[int] = []
    for text in texts:
        if len(stream) >= min_tokens:
            break
        stream.extend(encode(text))
        stream.extend(sep)
    return stream


def corpus_texts(data_dir: Path, datasets: Sequence[str], seed: int) -> list[str]:
    """The test-split documents of the named staged datasets, interleaved, in a seeded order."""
    from condcomp.experiments.llm.data import dataset_documents

    per = [dataset_documents(name, data_dir, "test", seed) for name in datasets]
    return [doc for group in zip(*per) for doc in group]


def draw_offsets(stream_len: int, window: int, n: int, rng: random.Random) -> list[int]:
    if stream_len < window:
        raise ValueError(f"the haystack holds {stream_len} tokens, fewer than one case's {window}: add documents "
                         "(more --datasets) or shorten the prompt")
    return [rng.randrange(0, stream_len - window + 1) for _ in range(n)]


def continuation_cases(stream: Sequence[int], prompt_len: int, cont_len: int, n: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``prompt_len + cont_len + 1`` stream tokens at offsets drawn from ``seed`` and the lengths."""
    rng = random.Random(f"continuation/{seed}/{prompt_len}/{cont_len}")
    window = prompt_len + cont_len + 1
    return [list(stream[o:o + window]) for o in draw_offsets(len(stream), window, n, rng)]


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
        (offset,) = draw_offsets(len(stream), H, 1, rng)
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


@dataclass(frozen=True)
class RetrievalCase:
    """One retrieval prompt: ``ids`` (the context, exactly the prompt length, prefilled into the cache; question-aware:
    followed by the question but its last token), then ``question`` (fed through that cache: the question, its last
    token when question-aware, nothing when the question is inside the context), the asked ``key``, its
    relative depth, and the start of every planted fact in ``ids``."""

    ids: list[int]
    question: list[int]
    key: str
    depth: float
    fact_starts: tuple[int, ...]


FACTS_HEAD = "Some pass keys are hidden in the text below. Remember them.\n\n"
FACT = "The pass key of {name} is {key}."
FIRST_NAMES = ("Alice", "Bruno", "Carmen", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid", "Jonas", "Keiko",
               "Liam", "Marta", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Stefan", "Tomas", "Ursula", "Victor",
               "Wanda", "Yusuf")
LAST_NAMES = ("Abbott", "Berger", "Castillo", "Dalton", "Eriksen", "Fischer", "Garnier", "Holloway", "Ivanova",
              "Jensen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quinlan", "Rossi",
              "Sandoval", "Tanaka", "Ulrich", "Varga", "Whitfield", "Zeller")


QUESTION_FORMAT = "\n\nQuestion: What is the pass key of {name}?\nAnswer: The pass key of {name} is"
COMPLETION_FORMAT = "\n\nThe pass key of {name} is"
QUESTION_FORMS = ("completion", "qa")


def facts_question(example: tuple[str, str] | None, asked: str, form: str = "qa") -> str:
    """The question. ``completion``: the asked fact's opening words (``example`` unused, may be None); ``qa``: one
    fact asked and answered as an example, then the asked name's question.

    >>> facts_question(None, "Rosa Novak", "completion")
    '\\n\\nThe pass key of Rosa Novak is'
    """
    if form == "completion":
        return COMPLETION_FORMAT.format(name=asked)
    if form != "qa":
        raise ValueError(f"unknown facts question form {form!r} (--question-form); choose from "
                         f"{', '.join(QUESTION_FORMS)}")
    if example is None:
        raise ValueError("the qa question form shows another fact as an example: pass one")
    shown = QUESTION_FORMAT.format(name=example[0]) + f" {example[1]}."
    return shown + QUESTION_FORMAT.format(name=asked)


def facts_cases(stream: Sequence[int], encode: Encode, prompt_len: int, n: int, seed: int, n_facts: int = 4,
                in_context: bool = False, prefix_ids: Sequence[int] = (), question_form: str = "completion",
                question_aware: bool = False) -> list[RetrievalCase]:
    """``n`` contexts of exactly ``prompt_len`` tokens with ``n_facts`` facts each (distinct names and keys);
    case i asks fact ``i % n_facts`` (in depth order), so every depth slice is asked equally often. The question
    reads as ``question_form`` (:func:`facts_question`).

    Fact j starts after ``round(d_j * H)`` haystack tokens (H: the haystack tokens in the context), ``d_j`` drawn
    uniformly in the j-th of ``n_facts`` equal slices of [0.05, 0.95]. The question of every case has the same
    token count (names and keys are redrawn until it does), so that a batch feeds its questions in one step.

    ``in_context``: the question ends the ``prompt_len`` tokens (the haystack is shorter by it) and is not fed
    again. ``question_aware``: the same context as without it, followed by the question but its last token (all
    compressed together, so the selection sees the question), that last token fed after the compressed context:
    the text is the question-agnostic case's, and every answer token is still read through the compressed cache
    (kvpress's question-aware setting; asking the whole question twice makes SmolLM2 repeat it).
    """
    if in_context and question_aware:
        raise ValueError("--question-in-context and --question-aware are two ways to put the question in the "
                         "compressed context: give one (--question-aware also asks it again after the context)")
    if question_form not in QUESTION_FORMS:
        raise ValueError(f"unknown facts question form {question_form!r} (--question-form); choose from "
                         f"{', '.join(QUESTION_FORMS)}")
    least = 2 if question_form == "qa" else 1
    if n_facts < least:
        raise ValueError(f"the facts task needs at least {least} fact(s) per case with the {question_form} question "
                         f"form{' (one asked, one as the example)' if least == 2 else ''}, got {n_facts}")
    rng = random.Random(f"facts/{seed}/{prompt_len}/{n_facts}")
    head = list(prefix_ids) + encode(FACTS_HEAD)
    width = 0.9 / n_facts
    cases: list[RetrievalCase] = []
    q_len: int | None = None
    for i in range(n):
        for _ in range(1000):
            # no first or last name shared inside a context: "Keiko Varga" asked beside "Keiko Berger" tests the
            # name, not the retrieval
            names = [f"{f} {ln}" for f, ln in zip(rng.sample(FIRST_NAMES, n_facts), rng.sample(LAST_NAMES, n_facts))]
            keys = [str(k) for k in rng.sample(range(1000, 10000), n_facts)]
            asked = i % n_facts
            shown = None
            if question_form == "qa":  # drawn only here: qa cases are the ones drawn before completion existed
                example = rng.choice([j for j in range(n_facts) if j != asked])
                shown = (names[example], keys[example])
            question = encode(facts_question(shown, names[asked], question_form))
            if q_len is None or len(question) == q_len:
                q_len = len(question)
                break
        else:
            raise ValueError("no facts question of the first case's token count in 1000 draws; this tokenizer "
                             "splits names too unevenly for batched questions")
        depths = [0.05 + width * (j + rng.random()) for j in range(n_facts)]
        facts = [encode("\n\n" + FACT.format(name=nm, key=k) + "\n\n") for nm, k in zip(names, keys)]
        tail = question if in_context else []
        H = prompt_len - len(head) - sum(map(len, facts)) - len(tail)
        if H < n_facts:
            raise ValueError(f"a facts context of {prompt_len} tokens leaves no room for haystack text "
                             f"({n_facts} facts, head and question take {prompt_len - H}); use a longer prompt or "
                             "fewer facts")
        (offset,) = draw_offsets(len(stream), H, 1, rng)
        hay = list(stream[offset:offset + H])
        ids, starts, prev = list(head), [], 0
        for d, fact in zip(depths, facts):
            cut = round(d * H)
            ids += hay[prev:cut]
            starts.append(len(ids))
            ids += fact
            prev = cut
        ids += hay[prev:] + tail + (question[:-1] if question_aware else [])
        asked_after = [] if in_context else question[-1:] if question_aware else question
        cases.append(RetrievalCase(ids, asked_after, keys[asked], depths[asked], tuple(starts)))
    return cases


def as_retrieval(case: PasskeyCase) -> RetrievalCase:
    """A passkey case as a retrieval case (its question is inside the context)."""
    return RetrievalCase(case.ids, [], case.key, case.depth, (case.needle_start,))


def retrieval_cases(task: str, stream: Sequence[int], encode: Encode, prompt_len: int, n: int, seed: int,
                    prefix_ids: Sequence[int], fmt: PasskeyFormat | None, n_facts: int = 4, in_context: bool = False,
                    question_form: str = "completion", question_aware: bool = False) -> list[RetrievalCase]:
    """The retrieval cases of ``task`` at one prompt length: ``facts`` (:func:`facts_cases`) or ``passkey`` (the
    quotes task's are :func:`condcomp.bench.kv_quotes.quote_cases`)."""
    if task == "passkey":
        return [as_retrieval(c) for c in passkey_cases(stream, encode, prompt_len, n, seed, prefix_ids=prefix_ids,
                                                       fmt=fmt or RAW)]
    if task != "facts":
        raise ValueError(f"unknown retrieval task {task!r}; choose facts or passkey (quotes: kv_quotes.quote_cases)")
    return facts_cases(stream, encode, prompt_len, n, seed, n_facts=n_facts, in_context=in_context,
                       prefix_ids=prefix_ids, question_form=question_form, question_aware=question_aware)
