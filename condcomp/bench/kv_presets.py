"""What a ``condcomp bench kv`` run measures (its presets) and the model and tokenizer it measures them on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from condcomp.bench.decode import load_model
from condcomp.bench.kv_cases import COPY, QUESTION_FORMS, RAW, PasskeyFormat, chat_format
from condcomp.bench.kv_text import DEFAULT_CORPORA

TASKS = ("facts", "passkey", "quotes")
# what separates the haystack's documents: a blank line, or the tokenizer's document separator (<|endoftext|>)
HAYSTACK_SEPS = ("blank", "eos")


@dataclass(frozen=True)
class Preset:
    """How much a run measures. Case counts: one for every prompt length, or one per length (a tuple, in the order
    of ``prompts``). ``batch``: cases per forward; the decode timing runs its own prompt and batch.
    ``task``: the retrieval task, ``facts`` (``facts`` facts per context, one asked; the question, in the form
    ``question_form`` (:func:`condcomp.bench.kv_cases.facts_question`), fed after the context unless
    ``question_in_context``), ``passkey`` (one key, the question inside the prompt, read as
    ``passkey_format``: :func:`passkey_format`) or ``quotes`` (a passage of the context's own text quoted after it,
    its next words the answer: :mod:`condcomp.bench.kv_quotes`). ``passkey_cases``: the retrieval cases of any
    task."""

    prompts: tuple[int, ...]
    passkey_cases: int | tuple[int, ...]
    ppl_cases: int | tuple[int, ...]
    cont_len: int
    batch: int
    decode_prompt: int
    decode_batch: int
    decode_tokens: int
    answer_tokens: int = 8
    passkey_format: str = "copy"
    task: str = "facts"
    facts: int = 4
    question_in_context: bool = False
    question_aware: bool = False
    question_form: str = "completion"
    haystack_sep: str | None = None  # None: the task's own (:meth:`separator`)

    def __post_init__(self) -> None:
        # a count of 0 ends in an empty case list deep in the run (an IndexError); refuse it here, by name
        flags = {"prompts": " (--prompts)", "passkey_cases": " (--passkey-cases)",
                 "decode_prompt": " (--decode-prompt)", "decode_batch": " (--decode-batch)"}
        for name in ("prompts", "passkey_cases", "ppl_cases", "cont_len", "batch", "decode_prompt", "decode_batch",
                     "decode_tokens", "answer_tokens", "facts"):
            v = getattr(self, name)
            vals = (v,) if isinstance(v, int) else v
            if not vals or any(x < 1 for x in vals):
                raise ValueError(f"{name} must be one or more values >= 1, got {v!r}{flags.get(name, '')}")
        if self.task not in TASKS:
            raise ValueError(f"unknown retrieval task {self.task!r} (--task); choose from {', '.join(TASKS)}")
        if self.question_form not in QUESTION_FORMS:
            raise ValueError(f"unknown facts question form {self.question_form!r} (--question-form); choose from "
                             f"{', '.join(QUESTION_FORMS)}")
        if self.haystack_sep not in (None, *HAYSTACK_SEPS):
            raise ValueError(f"unknown haystack separator {self.haystack_sep!r} (--haystack-sep); choose from "
                             f"{', '.join(HAYSTACK_SEPS)}")
        if self.question_in_context and self.question_aware:
            raise ValueError("--question-in-context and --question-aware both put the question in the compressed "
                             "context: give one (--question-aware also asks it again after the context)")
        if self.task == "facts" and self.question_form == "qa" and self.facts < 2:
            raise ValueError(f"--question-form qa shows another fact as an example: it needs --facts 2 or more, got "
                             f"{self.facts}")

    def separator(self) -> str:
        """What separates the haystack's documents: ``haystack_sep``, else the task's own: ``blank`` for facts and
        quotes (SmolLM2 reads what follows <|endoftext|> as a new document and stops recalling facts before it:
        results/kv_facts_screen/README.md), ``eos`` for passkey (its committed records were measured so)."""
        return self.haystack_sep or ("eos" if self.task == "passkey" else "blank")

    def task_settings(self) -> dict[str, Any]:
        """The task's fields a record holds in its settings (a record of other values is measured again); none for
        the passkey task on its own separator, so that records written before these fields are still read back."""
        sep = {"haystack_sep": self.separator()} if self.separator() != "eos" else {}
        if self.task == "passkey":
            return sep
        if self.task == "quotes":
            from condcomp.bench.kv_quotes import ANSWER_WORDS, CUE_TOKENS

            return {"task": "quotes", "cue_tokens": CUE_TOKENS, "answer_words": ANSWER_WORDS,
                    "haystack_sep": self.separator()}
        aware = {"question_aware": True} if self.question_aware else {}  # absent when off: older records read back
        return {"task": self.task, "facts": self.facts, "question_in_context": self.question_in_context,
                **aware, "question_form": self.question_form, "haystack_sep": self.separator()}

    def cases(self, prompt_len: int) -> tuple[int, int]:
        """``(passkey cases, continuation cases)`` at one prompt length."""
        i = self.prompts.index(prompt_len)

        def pick(v: int | tuple[int, ...]) -> int:
            return v if isinstance(v, int) else v[min(i, len(v) - 1)]
        return pick(self.passkey_cases), pick(self.ppl_cases)

    def at_lengths(self, prompts: tuple[int, ...]) -> Preset:
        """The preset at other prompt lengths: a length it already measures keeps its own case counts, a new one
        takes those of the preset's longest length."""
        def counts(v: int | tuple[int, ...], which: int) -> int | tuple[int, ...]:
            if isinstance(v, int):
                return v
            return tuple(self.cases(P if P in self.prompts else max(self.prompts))[which] for P in prompts)
        return replace(self, prompts=prompts, passkey_cases=counts(self.passkey_cases, 0),
                       ppl_cases=counts(self.ppl_cases, 1))


PRESETS = {
    "full": Preset((2048, 4096), passkey_cases=50, ppl_cases=8, cont_len=128, batch=5, decode_prompt=2048,
                   decode_batch=8, decode_tokens=16),
    "cpu": Preset((1024, 2048), passkey_cases=10, ppl_cases=(2, 5), cont_len=64, batch=5,
                  decode_prompt=512, decode_batch=2, decode_tokens=8),
    "cpu-2048": Preset((2048,), passkey_cases=10, ppl_cases=4, cont_len=64, batch=5, decode_prompt=2048,
                       decode_batch=8, decode_tokens=16, passkey_format="copy"),
    "quick": Preset((320,), passkey_cases=2, ppl_cases=2, cont_len=8, batch=2, decode_prompt=32, decode_batch=2,
                    decode_tokens=3, answer_tokens=4, passkey_format="raw"),
}
PRESET_HELP = ("full: prompts 2048 and 4096, 50 retrieval cases (a GPU's run); cpu-2048: prompt 2048, 10 cases, "
               "4 continuations (what one thread of a loaded 2-core CPU measures in an hour); cpu: 1024 and 2048, 10 "
               "cases; quick: a smoke run. Decode is timed at 2048 x 8 (cpu: 512 x 2)")
CORPORA = DEFAULT_CORPORA  # the staged corpora of the default haystack
PASSKEY_FORMATS = ("copy", "raw", "chat")


class ByteTokenizer:
    """The tiny random model's tokenizer: UTF-8 bytes (ids 0..255), separator 256. Keeps runs download-free."""

    sep_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def load(model_name: str) -> tuple[nn.Module, Any, int, list[int]]:
    """``(model, tokenizer with encode/decode, separator id, prompt prefix ids)``."""
    if model_name == "tiny-llama":
        return load_model(model_name), ByteTokenizer(), ByteTokenizer.sep_id, []
    from condcomp.experiments.llm.data import tokenizer_encoder
    from condcomp.experiments.llm.smollm2 import load_smollm2

    model, tok = load_smollm2()
    _, sep = tokenizer_encoder(tok)
    tok.encode_plain = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # type: ignore[attr-defined]
    return model, tok, sep, []


def encoder(tok: Any) -> Any:
    """``text -> ids`` without special tokens added (the tokenizer's plain encoder)."""
    return getattr(tok, "encode_plain", None) or tok.encode


def separator_ids(preset: Preset, sep_id: int, tok: Any) -> list[int]:
    """The token ids between two haystack documents: ``sep_id`` (the tokenizer's separator) or a blank line."""
    return [sep_id] if preset.separator() == "eos" else list(encoder(tok)("\n\n"))


# bench kv's retrieval flags that apply to one task only: (Preset field, the task it applies to, the flag)
TASK_ONLY = (("passkey_format", "passkey", "--passkey-format"), ("facts", "facts", "--facts"),
             ("question_form", "facts", "--question-form"), ("question_in_context", "facts", "--question-in-context"),
             ("question_aware", "facts", "--question-aware"))


def refuse_other_task_options(task: str, given: Iterable[str]) -> None:
    """Refuse, by name, flags in ``given`` (Preset fields set on the command line) that the ``task`` does not read:
    a run would ignore them (``--passkey-format chat`` with the facts task, where no passkey prompt is built)."""
    wrong = [(flag, applies) for field, applies, flag in TASK_ONLY if field in set(given) and applies != task]
    if wrong:
        other = wrong[0][1]
        flags = ", ".join(flag for flag, _ in wrong)
        raise ValueError(f"{flags}: only the {other} task reads {'it' if len(wrong) == 1 else 'them'}, and this run's "
                         f"task is {task} (--task, or the preset's); pass --task {other}, or drop "
                         f"{'it' if len(wrong) == 1 else 'them'}")


# the Preset fields bench kv's flags override (None: not given)
OVERRIDES = ("decode_prompt", "decode_batch", "passkey_format", "task", "facts", "question_form", "question_in_context",
             "question_aware", "haystack_sep", "ppl_cases")


def with_overrides(preset: Preset, args: Any) -> Preset:
    """``preset`` with the fields ``args`` (bench kv's parsed flags) give; a flag its task does not read is refused
    (:func:`refuse_other_task_options`), and so are the decode timing's sizes when nothing is timed."""
    given = {f: getattr(args, f) for f in OVERRIDES if getattr(args, f) is not None}
    preset = replace(preset, **given)
    refuse_other_task_options(preset.task, given)
    timing = [f"--{f.replace('_', '-')}" for f in ("decode_prompt", "decode_batch") if f in given]
    if getattr(args, "time_decode", None) == [] and timing:
        raise ValueError(f"{', '.join(timing)} size the decode timing, and --time-decode without names times "
                         "nothing; name the variants to time, or drop them")
    return preset


def passkey_format(name: str, tok: Any) -> PasskeyFormat:
    """``copy``: the question ends with the needle's opening words (the key is what followed them); ``raw``: the
    classic passkey prompt as plain text; ``chat``: the same in the tokenizer's chat template (the
    instruct model's own format), the answer primed with "The pass key is" (results/kv/README.md: the screen)."""
    if name in ("raw", "copy"):
        return RAW if name == "raw" else COPY
    if name != "chat":
        raise ValueError(f"unknown passkey format {name!r}; choose from {', '.join(PASSKEY_FORMATS)}")
    if not callable(getattr(tok, "apply_chat_template", None)) or not getattr(tok, "chat_template", None):
        raise ValueError("passkey format 'chat' needs a tokenizer with a chat template (the tiny model's byte "
                         "tokenizer has none): use --passkey-format raw")

    def render(user: str) -> str:
        return str(tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                           add_generation_prompt=True))
    return chat_format(render)


def add_task_arguments(parser: Any) -> None:
    """``bench kv``'s retrieval-task options (override the preset's)."""
    from condcomp.cli_args import integer

    parser.add_argument("--cases", "--passkey-cases", dest="passkey_cases", type=integer(at_least=1), nargs="+",
                        default=None, help="override the preset's retrieval cases: one count, or one per prompt length")
    parser.add_argument("--continuations", dest="ppl_cases", type=integer(at_least=1), default=None,
                        help="override the preset's perplexity windows per prompt length (each a prompt and "
                             "cont_len continuation tokens scored through the cache)")
    parser.add_argument("--task", default=None, choices=TASKS,
                        help="the retrieval task: facts (default: several facts 'The pass key of <name> is <4 "
                             "digits>.' at distinct depths, one asked after the context), passkey (one key, asked "
                             "inside it) or quotes (16 tokens of the context's own text quoted after it; found when "
                             "the answer's first 3 words are the words that follow them)")
    parser.add_argument("--facts", type=integer(at_least=1), default=None,
                        help="facts per context of the facts task (default 4: with the completion question, the "
                             "most that dense SmolLM2-135M passed at 1024 tokens, 9 of 10 keys in "
                             "results/kv_facts_screen)")
    parser.add_argument("--question-form", default=None, choices=QUESTION_FORMS,
                        help="facts task: how the question reads. completion (default): the asked fact's opening "
                             "words 'The pass key of <name> is', for the model to complete; qa: 'Question: ... "
                             "Answer: ...' with another fact and its key as an example (needs --facts 2 or more)")
    parser.add_argument("--haystack-sep", default=None, choices=HAYSTACK_SEPS,
                        help="what separates the haystack's documents: a blank line (the facts task's default) or "
                             "the tokenizer's document separator, <|endoftext|> (the passkey task's)")
    parser.add_argument("--question-in-context", action="store_const", const=True, default=None,
                        help="facts task: the question ends the prefilled context (the cache is compressed knowing "
                             "it) instead of being fed after it")
    parser.add_argument("--question-aware", action="store_const", const=True, default=None,
                        help="facts task, question-aware mode (kvpress's): the same context followed by the "
                             "question but its last token is compressed (the selection sees the question), that "
                             "token is fed after it, so every answer token reads the compressed cache; refused for "
                             "tasks without a question after the context (passkey, quotes)")
