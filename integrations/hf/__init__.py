"""Hugging Face transformers 5.x: condcomp's adapters for transformers attention classes, one module per family.

Read in this order:

1. :mod:`.common`: what every adapter shares, in the order a forward uses it: binding the call's arguments
   (:func:`~.common.bind_arguments`), reading transformers' masks (:func:`~.common.mask_parts`), every head's keys
   and values into the cache (:func:`~.common.cache_every_head`, :func:`~.common.cross_attention_states`), and the
   step every forward ends with (:func:`~.common.attend_call`: mask parts -> plan -> ``attend`` -> the plan kept);
   the base class :class:`~.common.TransformersAdapter` (class + structure matching, the ``attn_implementation``
   check). Splitting a projection into heads is :func:`condcomp.dense.split_heads`.
2. The families, each an :class:`~condcomp.AttentionAdapter` registered on import:
   :mod:`.bert` (``BertAttention``, ``RobertaAttention``), :mod:`.projection` (``ViTAttention`` and the Llama
   family), :mod:`.gpt2`, :mod:`.t5`, :mod:`.plain` (the base of :mod:`.distilbert` and :mod:`.clip`: CLIP and
   SigLIP). Supporting a new architecture means adding a module here (docs/extending-models.md).
3. Decoding with a KV cache: :mod:`.cache` (the request plan a cache holds, per layer) and :mod:`.decode` (a held
   plan's kept key/value groups, projected and cached alone).
4. Around the adapters: :mod:`.interface` (the other attachment: a ``"condcomp"`` attention function in
   transformers' ``AttentionInterface``, no module swap), :mod:`.checkpoint` (``save_pretrained`` /
   ``from_pretrained`` with the routing record), :mod:`.trainer` (``CondCompCallback`` for the ``Trainer``).

A class is recognised when it is one of the known classes (or one registered with
:func:`register_transformers_attention`) *and* its parameters have exactly the expected structure; anything else
is refused with the reason. Importing this package imports transformers (``import condcomp`` does not).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

OLDEST_TRANSFORMERS = (5, 24)

try:
    import transformers
except ImportError as missing:  # pragma: no cover - exercised in a subprocess by test_transformers_version
    _PIN = f"transformers>={OLDEST_TRANSFORMERS[0]}.{OLDEST_TRANSFORMERS[1]},<6"
    raise ImportError(f"condcomp.integrations.hf needs {_PIN}, which is not installed: pip install -e '.[hf]' from "
                      f"the repository's root, or pip install '{_PIN}'") from missing


def require_transformers(version: str, oldest: tuple[int, int] = OLDEST_TRANSFORMERS) -> None:
    """Refuse a transformers older than ``oldest`` (or a 6.x): before 5.24 a decoder's attention receives its KV
    cache as ``past_key_values``, which the adapters do not read, so generation would run without the cache."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ImportError(f"condcomp.integrations.hf: cannot read the transformers version {version!r}; "
                          "install transformers>=5.24,<6 (pip install -e '.[hf]')")
    major_minor = (int(found.group(1)), int(found.group(2)))
    if major_minor < oldest or major_minor[0] >= 6:
        raise ImportError(f"condcomp.integrations.hf needs transformers>={oldest[0]}.{oldest[1]},<6 (its attention "
                          f"layers take the KV cache as `cache`), found {version}: pip install -e '.[hf]' from the "
                          "repository's root, or pip install 'transformers>=5.24,<6'")


require_transformers(transformers.__version__)

# The families' adapters register themselves on import.
from . import clip, distilbert, gpt2, t5  # noqa: E402, F401
from .bert import BertStyleAttentionAdapter  # noqa: E402
from .common import TransformersAdapter  # noqa: E402
from .projection import ProjectionAttentionAdapter  # noqa: E402

__all__ = ["BertStyleAttentionAdapter", "ProjectionAttentionAdapter", "register_transformers_attention",
           "supported_transformers_classes"]

def register_transformers_attention(cls: type, family: str) -> None:
    """Make ``apply_`` wrap another transformers attention class that copies a supported one.

    ``family`` is ``"bert"`` (``.self`` + ``.output`` like ``BertAttention``) or ``"projection"``
    (``q_proj``/``k_proj``/``v_proj``/``o_proj`` like ``LlamaAttention``). The structure is still checked per
    module, so a class that only looks similar is refused with the reason rather than silently mis-computed.

    >>> from transformers.models.electra.modeling_electra import ElectraAttention  # doctest: +SKIP
    >>> register_transformers_attention(ElectraAttention, "bert")  # doctest: +SKIP
    """
    adapters: dict[str, type[TransformersAdapter]] = {"bert": BertStyleAttentionAdapter,
                                                       "projection": ProjectionAttentionAdapter}
    if family not in adapters:
        raise ValueError(f"family must be one of {sorted(adapters)}, got {family!r}")
    adapter = adapters[family]
    if cls not in adapter.module_types:
        adapter.module_types = (*adapter.module_types, cls)


def supported_transformers_classes() -> list[str]:
    """Names of the transformers attention classes the module swap recognises (every family)."""
    from condcomp.adapters import registered_adapters

    return sorted({t.__name__ for a in registered_adapters() for t in a.module_types
                   if t.__module__.startswith("transformers.")})


# Reached as attributes of the package, imported on first access: importing the package loads the adapters only
# (the Trainer callback imports transformers' trainer machinery).
_LAZY_NAMES = {"CondCompCallback": "trainer", "from_pretrained": "checkpoint", "save_pretrained": "checkpoint"}
_LAZY_SUBMODULES = ("checkpoint", "interface", "trainer")


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES, *_LAZY_SUBMODULES})
