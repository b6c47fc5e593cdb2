"""Runs one ``condcomp`` command as a user would, for tests/test_resume.py to interrupt (not a test module).

``python tests/resume_child.py SETUP ARGS...``: Ctrl-C's handler is put back first (a child started from a
background job inherits SIGINT ignored; a user's terminal has Python's default, which raises KeyboardInterrupt),
then ``SETUP`` swaps the downloads for tiny local stand-ins and ``condcomp ARGS...`` runs:

- ``corpus``: the corpora of ``bench kv`` / ``calibrate-kv`` are a few fixed word texts (the model is tiny-llama;
  no staged corpora needed);
- ``tiny-smollm``: ``tune-llm``'s SmolLM2 is a tiny random Llama with a character tokenizer;
- ``quick-judge``: ``dit``'s judge (the classifier its metrics use) trains for 3 steps;
- ``none``: nothing is swapped.
"""

from __future__ import annotations

import random
import signal
import sys

signal.signal(signal.SIGINT, signal.default_int_handler)

TEXTS = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta"]) for _ in range(80))
         for i in range(30)]


def corpus() -> None:
    import condcomp.bench.kv as kv
    import condcomp.bench.kv_cases as kv_cases
    import condcomp.experiments.llm.calibrate_kv as calibrate_kv

    kv.corpus_texts = kv_cases.corpus_texts = lambda *a, **k: list(TEXTS)  # type: ignore[assignment]
    # calibrate-kv reads the staged corpora (a clone has none): its texts argument, as its own tests pass it
    real_run = calibrate_kv.run
    calibrate_kv.run = lambda args, texts=None: real_run(args, list(TEXTS) if texts is None else texts)  # type: ignore[assignment]


def tiny_smollm() -> None:
    from tiny_models import tiny_char_llama  # this script's folder (tests/) is on sys.path

    import condcomp.experiments.llm.smollm2 as smollm2

    smollm2.load_smollm2 = tiny_char_llama  # type: ignore[assignment]


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
