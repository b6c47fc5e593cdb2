"""The KV cache of a decoder request: what it keeps per key/value group, how it is stored, chosen and counted.

Read it in this order:

1. policy.py: the KV policy, the fourth role: what a group the request's plan does not keep holds (``drop``,
   ``full``, or a state of the policy's own) and everything about that state (attend, rows, crop, bytes);
   position_bias.py: a model's relative position bias (T5's) that a policy adds at its kept keys' true distances.
2. window.py: the ``window`` policy's storage, a trimmed per-layer cache of sinks + recent tokens, and its
   block-banded prefill; window_quant.py: the same window stored quantized inside a quantized cache.
3. window_policy.py: the ``window`` policy itself (StreamingLLM / DuoAttention's streaming heads); snapkv.py:
   ``snapkv``, the prompt tokens its last queries attend to most (SnapKV); adakv.py: ``adakv``, one token budget
   per layer shared by its groups by those scores (AdaKV); headkv.py: ``headkv``, each group its own share of the
   prompt (HeadKV), and headkv_budget.py: those shares from one byte budget over the model by importance scores.
4. selection.py: per request and layer, which groups the plan keeps in full and which its policy holds, in the
   compact slot order the cache stores them (:class:`KVSelection`), the plan held with the cache
   (:class:`HeldPlan`) and its public view (:class:`RequestPlan`).
5. layer.py: one layer of a request's cache (:class:`~condcomp.kv.layer.CompactLayer`): the plan and the KV
   policy's state beside the kept groups' keys, the row operations on both, and how the ``kv_cache`` executor
   writes it (``store``, ``policy_state``, ``keep_policy_state``).
6. choose.py: the policy of a wrapped layer: ``CondCompConfig(kv=...)`` or the ``topk`` router's ``stream_window``.
7. calibration.py: which groups a plan keeps in full, from calibration (``duo_split``, ``static_split``,
   ``request_split``), and what makes their inputs: duo_attention.py and duo_gates.py (DuoAttention's gates),
   continuation.py and importance.py (gradient importance on the continuation loss), request_router.py (a trained
   per-request router).

The executor that computes over it is ``kv_cache`` (:mod:`condcomp.executors.cached`); the transformers cache layer
that holds it is condcomp's own (:mod:`condcomp.integrations.hf.kv_layer`, installed on a user's cache by
:func:`adopt`), and :mod:`condcomp.integrations.hf.cache`'s ``cache_bytes`` counts it.

>>> import condcomp
>>> {'drop', 'full', 'window', 'snapkv', 'adakv', 'headkv'} <= set(condcomp.list_kv_policies())
True
"""

from typing import Any

from condcomp.kv.adakv import AdaKV
from condcomp.kv.choose import build_kv_policy, kv_policy_of
from condcomp.kv.headkv import HeadKV
from condcomp.kv.policy import KV_FULL, KV_MODE_NAMES, KV_NONE, KV_WINDOW, DropKV, FullKV, KVPolicy
from condcomp.kv.position_bias import RelativeBias
from condcomp.kv.selection import HeldPlan, KVSelection, RequestPlan, as_kv_policy, decision_mask, pad_slots, select_kv
from condcomp.kv.snapkv import SnapKV, SnapState
from condcomp.kv.window import StreamWindow, WindowCache
from condcomp.kv.window_policy import WindowKV
from condcomp.kv.window_quant import QuantizedWindowCache, WindowCodec


def adopt(cache: Any) -> Any:
    """Install condcomp's cache layer on a transformers KV cache a user builds, and return the cache.

    Each layer of ``cache`` (``DynamicCache``, ``QuantizedCache`` for fp8/HQQ/quanto, ``StaticCache``, both halves of
    an ``EncoderDecoderCache``) is wrapped by condcomp's layer, which holds a request's plan and its KV policy's
    state beside the keys the wrapped layer keeps storing and quantizing; every cache operation (``reset``,
    ``crop``, ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``, ``copy.deepcopy``,
    ``pickle``) then acts on both. A wrapped model adopts a cache itself at a request's first cached call, so
    ``generate()`` needs no call; adopt a cache explicitly to hold condcomp's layers before it is filled. Calling
    it twice changes nothing. Refused with the reason: a ``PagedAttentionCache`` (continuous batching) and layers
    that are not attention cache layers. Needs transformers.

    >>> import transformers, condcomp  # doctest: +SKIP
    >>> cache = condcomp.kv.adopt(transformers.QuantizedCache("fp8", model.config))  # doctest: +SKIP
    >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)  # doctest: +SKIP
    """
    from condcomp.integrations.hf.kv_layer import adopt as adopt_cache

    return adopt_cache(cache)


__all__ = ["AdaKV", "HeadKV", "KV_FULL", "KV_MODE_NAMES", "KV_NONE", "KV_WINDOW", "DropKV", "FullKV", "HeldPlan",
           "KVPolicy", "KVSelection", "QuantizedWindowCache", "RelativeBias", "RequestPlan", "SnapKV", "SnapState",
           "StreamWindow", "WindowCache", "WindowCodec", "WindowKV", "adopt", "as_kv_policy", "build_kv_policy",
           "decision_mask", "kv_policy_of", "pad_slots", "select_kv"]
