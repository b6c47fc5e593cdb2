"""Runs one ``condcomp`` command as a user would, for tests/test_resume.py to interrupt (not a test module).

``python tests/resume_child.py SETUP ARGS...``: Ctrl-C's handler is put back first (a child started from a
background job inherits SIGINT ignored; a user's terminal has Python's default, which raises KeyboardInterrupt),
then ``SETUP`` swaps the downloads for tiny local stand-ins and ``condcomp ARGS...`` runs:

- ``corpus``: the corpora of ``bench kv`` / ``calibrate-kv`` are a few fixed word texts (the model is tiny-llama);
- ``tiny-smollm``: ``tune-llm``'s SmolLM2 is a tiny random Llama with a character tokenizer;
- ``quick-judge``: ``dit``'s judge (the classifier its metrics use) trains for 3 steps;
- ``none``: nothing is swapped.
"""

from __future__ import annotations

import random
import signal
import sys
from typing import Any

signal.signal(signal.SIGINT, signal.default_int_handler)

TEXTS = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta"]) for _ in range(80))
         for i in range(30)]


def corpus() -> None:
    import condcomp.bench.kv as kv
    import condcomp.bench.kv_cases as kv_cases

    kv.corpus_texts = kv_cases.corpus_texts = lambda *a, **k: list(TEXTS)  # type: ignore[assignment]


class CharTokenizer:
    pad_token_id, eos_token_id = 1, 2

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        return {"input_ids": [[3 + (ord(c) % 90) for c in t] for t in texts]}

    def get_vocab(self) -> dict[str, int]:
        return {"<|endoftext|>": 0}

    def decode(self, tokens: Any) -> str:
        return "".join(chr(int(t)) for t in tokens)


def tiny_smollm() -> None:
    import torch
    import transformers

    import condcomp.experiments.llm.smollm2 as smollm2

    def load() -> tuple[Any, Any]:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                       max_position_embeddings=64, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg).eval(), CharTokenizer()

    smollm2.load_smollm2 = load  # type: ignore[assignment]


def quick_judge() -> None:
    import condcomp.experiments.dit.classifier as classifier

    real = classifier.train_judge
    classifier.train_judge = lambda images, labels: real(images, labels, steps=3)  # type: ignore[assignment]


SETUPS = {"corpus": corpus, "tiny-smollm": tiny_smollm, "quick-judge": quick_judge, "none": lambda: None}

if __name__ == "__main__":
    SETUPS[sys.argv[1]]()
    from condcomp.cli import main

    sys.argv = ["condcomp", *sys.argv[2:]]  # as the installed script sees it (commands record their command line)
    sys.exit(main(sys.argv[1:]))
