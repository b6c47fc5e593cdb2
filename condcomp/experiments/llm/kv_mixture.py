"""A calibration mixture for DuoAttention gates (``condcomp calibrate-kv --method duo --mix``), apart from bench kv.

The default calibration rows (:func:`condcomp.experiments.llm.duo_gates.calibration_rows`) are pass-key prompts
whose haystack is the *test* split bench kv's cases read. The mixture keeps the calibration text and wording apart
from every bench kv case:

- **Text**: the staged corpora's **train** split (bench kv reads the test split), minus any document whose cleaned
  text also occurs in the test split. The last :data:`HELD_OUT_DOCS` documents of each corpus (in a fixed order)
  are kept for the screen (``--evaluate --mix``); training rows never read them.
- **Rows**, each exactly ``seq_len`` tokens, three kinds in turn (row ``i`` is kind ``i % 3``):

  - ``facts``: 2-5 made-up facts in wordings other than bench kv's (:data:`WORDINGS`: no "pass key", names no bench
    kv case uses, 3-6 digit numbers) at drawn depths of the haystack, then one of them asked in its own words and
    answered at the row's end;
  - ``quote``: a passage of the row's own text (cues of :data:`CUE_LENGTHS` tokens, never the quotes task's 16)
    quoted after the context and continued with the :data:`CONTINUATION` tokens that followed it there;
  - ``plain``: consecutive text (the distillation loss on ordinary text).

Every row is drawn from ``random.Random`` seeded by the seed, the length and the row's index, so the first rows of
a larger ``n`` are the rows of a smaller one (a run can be extended).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from condcomp.experiments.llm.duo_gates import CalibrationRow

Encode = Callable[[str], list[int]]
KINDS = ("facts", "quote", "plain")
HELD_OUT_DOCS = 500  # per corpus: the screen's documents (the last of the train split in a fixed order)
CUE_LENGTHS = (8, 12, 24, 32)  # quoted tokens (bench kv's quotes task quotes 16)
CONTINUATION = 24  # the quoted passage's next tokens, which end the row
ANSWER_TOKENS = 4  # of those, the ones scored as the row's answer (teacher-forced screen)
QUOTE_DEPTHS = (0.05, 0.7)  # where in the context a quoted passage starts (mostly beyond a 256-token window)


@dataclass(frozen=True)
class Wording:
    """One kind of fact: ``statement`` as planted, ``question`` the words that ask it and end where the answer
    (`` <digits>``) starts; ``{who}`` is a person's name or a city (``subject``: "name" or "city")."""

    statement: str
    question: str
    subject: str


WORDINGS = (
    Wording("{who}'s locker code: {digits}", "Which code opens {who}'s locker? The code is", "name"),
    Wording("Reference number for the {who} office - {digits}", "The {who} office's reference number is", "city"),
    Wording("Flight {digits} was booked for {who}.", "Which flight was booked for {who}? Flight", "name"),
    Wording("{who} lives at house number {digits}.", "At which house number does {who} live? Number", "name"),
    Wording("Warehouse inventory for {who}: {digits} crates.", "How many crates are in the {who} warehouse?", "city"),
    Wording("Membership card of {who}, no. {digits}", "{who} holds the membership card numbered", "name"),
)
NAMES = ("Adaeze Moran", "Bertil Sandstrom", "Chiara Benedetti", "Desmond Oyelaran", "Emeka Chukwu", "Fiona MacLeod",
         "Gustavo Ribeiro", "Hanne Solberg", "Imran Qureshi", "Jasmin Haddad", "Kofi Mensah", "Leocadia Ferreira",
         "Mirela Dumitru", "Niamh Gallagher", "Orlando Vescovi", "Pavla Horakova", "Rafael Ortega", "Saoirse Kenny",
         "Tuomas Lehtinen", "Umberto Galli", "Vesna Kovacic", "Wilhelmina Brandt", "Xiomara Reyes", "Zoltan Farkas")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Tallinn", "Montevideo", "Auckland", "Krakow", "Quito", "Hanoi", "Tromso",
          "Adelaide", "Marrakesh", "Winnipeg", "Bergen", "Cusco", "Dakar")


@dataclass(frozen=True)
class MixRow(CalibrationRow):
    """A calibration row of the mixture: ``kind`` (:data:`KINDS`); ``answer`` the ``(start, end)`` of the answer's
    tokens (a fact's digits, or the quoted passage's first :data:`ANSWER_TOKENS` next tokens) and ``key`` their
    text, None and "" on a plain row."""

    kind: str = "plain"


def mixture_texts(data_dir: Path, corpora: Sequence[str], seed: int, held_out: bool = False) -> list[str]:
    """The train-split documents of ``corpora`` that the mixture reads, interleaved: training rows the documents
    before each corpus' last :data:`HELD_OUT_DOCS` (shuffled by ``seed``), the screen (``held_out``) those last
    ones; documents whose text is also in the test split are left out."""
    from condcomp.experiments.llm.data import dataset_documents

    per = []
    for name in corpora:
        test = set(dataset_documents(name, data_dir, "test", 0))
        docs = [d for d in dataset_documents(name, data_dir, "train", 0) if d not in test]
        if len(docs) <= 2 * HELD_OUT_DOCS:
            raise ValueError(f"{name}'s train split holds {len(docs)} documents not in its test split; the "
                             f"calibration mixture needs more than {2 * HELD_OUT_DOCS}")
        pool = docs[-HELD_OUT_DOCS:] if held_out else docs[:-HELD_OUT_DOCS]
        random.Random(f"kv-mix/{name}/{seed}/{held_out}").shuffle(pool)
        per.append(pool)
    return [doc for group in zip(*per) for doc in group]


def _facts_row(rng: random.Random, stream: Sequence[int], encode: Encode, seq_len: int) -> MixRow:
    n_facts = rng.randint(2, 5)
    wording = rng.choice(WORDINGS)
    who = rng.sample(NAMES if wording.subject == "name" else CITIES, n_facts)
    keys = [str(rng.randint(10 ** (d - 1), 10 ** d - 1)) for d in (rng.randint(3, 6) for _ in range(n_facts))]
    asked = rng.randrange(n_facts)
    facts = [encode("\n\n" + wording.statement.format(who=w, digits=k) + "\n\n") for w, k in zip(who, keys)]
    question = encode("\n\n" + wording.question.format(who=who[asked]))
    answer = encode(f" {keys[asked]}")
    H = seq_len - sum(map(len, facts)) - len(question) - len(answer)
    if H < n_facts:
        raise ValueError(f"a facts row of {seq_len} tokens leaves no room for text; use a longer --seq-len")
    offset = rng.randrange(0, len(stream) - H + 1)
    hay = list(stream[offset:offset + H])
    width = 1.0 / n_facts
    cuts = [round(width * (j + rng.random()) * H) for j in range(n_facts)]
    ids: list[int] = []
    prev = 0
    for cut, fact in zip(cuts, facts):
        ids += hay[prev:cut] + fact
        prev = cut
    ids += hay[prev:] + question
    start = len(ids)
    return MixRow(ids + answer, keys[asked], (start, start + len(answer)), "facts")


def _occurrences(ids: Sequence[int], part: Sequence[int]) -> int:
    n = len(part)
    return sum(1 for i in range(len(ids) - n + 1) if list(ids[i:i + n]) == list(part))


def _quote_row(rng: random.Random, stream: Sequence[int], encode: Encode, decode: Callable[[list[int]], str],
               seq_len: int, sep_ids: Sequence[int]) -> MixRow:
    lead = encode("\n\n")
    sep = set(sep_ids)
    for _ in range(200):
        cue_len = rng.choice(CUE_LENGTHS)
        C = seq_len - len(lead) - cue_len - CONTINUATION  # the context's tokens
        offset = rng.randrange(0, len(stream) - C + 1)
        context = list(stream[offset:offset + C])
        at = round(rng.uniform(*QUOTE_DEPTHS) * C)
        cue, after = context[at:at + cue_len], context[at + cue_len:at + cue_len + CONTINUATION]
        if len(after) == CONTINUATION and sep.isdisjoint(cue + after) and _occurrences(context, cue) == 1:
            start = C + len(lead) + cue_len
            return MixRow(context + lead + cue + after, decode(after[:ANSWER_TOKENS]), (start, start + ANSWER_TOKENS),
                          "quote")
    raise ValueError("no passage inside one document in 200 draws: the documents are shorter than a quote and its "
                     f"continuation ({max(CUE_LENGTHS) + CONTINUATION} tokens)")


def mixture_rows(stream: Sequence[int], encode: Encode, decode: Callable[[list[int]], str], seq_len: int, n: int,
                 seed: int, sep_ids: Sequence[int]) -> list[MixRow]:
    """``n`` rows of exactly ``seq_len`` tokens from the token ``stream`` (documents joined by ``sep_ids``): facts,
    quote and plain rows in turn (see the module docstring)."""
    if seq_len < 4 * (max(CUE_LENGTHS) + CONTINUATION):
        raise ValueError(f"mixture rows need --seq-len of at least {4 * (max(CUE_LENGTHS) + CONTINUATION)}, got "
                         f"{seq_len}")
    if len(stream) < 2 * seq_len:
        raise ValueError(f"the calibration text gives {len(stream)} tokens, fewer than two rows of {seq_len}: add "
                         "documents")
    rows = []
    for i in range(n):
        rng = random.Random(f"kv-mix/{seed}/{seq_len}/{i}")
        kind = KINDS[i % len(KINDS)]
        if kind == "facts":
            row = _facts_row(rng, stream, encode, seq_len)
        elif kind == "quote":
            row = _quote_row(rng, stream, encode, decode, seq_len, sep_ids)
        else:
            offset = rng.randrange(0, len(stream) - seq_len + 1)
            row = MixRow(list(stream[offset:offset + seq_len]), "", None, "plain")
        if len(row.ids) != seq_len:
            raise ValueError(f"a {kind} calibration row came out {len(row.ids)} tokens long, not {seq_len}")
        rows.append(row)
    return rows


__all__ = ["CITIES", "CUE_LENGTHS", "KINDS", "NAMES", "WORDINGS", "MixRow", "Wording", "mixture_rows",
           "mixture_texts"]
