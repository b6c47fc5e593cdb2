"""The KV cache of a decoder request: what it keeps per key/value group, how it is stored, chosen and counted.

Read it in this order:

1. policy.py: the KV policy, the fourth role: what a group the request's plan does not keep holds (``drop``,
   ``full``, or a state of the policy's own) and everything about that state (attend, rows, crop, bytes);
   position_bias.py: a model's relative position bias (T5's) that a policy adds at its kept keys' true distances.
2. window.py: the ``window`` policy's storage, a trimmed per-layer cache of sinks + recent tokens, and its
   block-banded prefill; window_quant.py: the same window stored quantized inside a quantized cache.
3. window_policy.py: the ``window`` policy itself (StreamingLLM / DuoAttention's streaming heads); snapkv.py:
   ``snapkv``, the prompt tokens its last queries attend to most (SnapKV); adakv.py: ``adakv``, one token budget
   per layer shared by its groups by those scores (AdaKV).
4. selection.py: per request and layer, which groups the plan keeps in full and which its policy holds, in the
   compact slot order the cache stores them (:class:`KVSelection`), the plan held with the cache
   (:class:`HeldPlan`) and its public view (:class:`RequestPlan`).
5. choose.py: the policy of a wrapped layer: ``CondCompConfig(kv=...)`` or the ``topk`` router's ``stream_window``.
6. calibration.py: which groups a plan keeps in full, from calibration (``duo_split``, ``static_split``,
   ``request_split``), and what makes their inputs: duo_attention.py and duo_gates.py (DuoAttention's gates),
   continuation.py and importance.py (gradient importance on the continuation loss), request_router.py (a trained
   per-request router).

The executor that computes over it is ``kv_cache`` (:mod:`condcomp.executors.cached`); the transformers cache layer
that holds it is :mod:`condcomp.integrations.hf.cache`, whose ``cache_bytes`` counts it.

>>> import condcomp
>>> {'drop', 'full', 'window', 'snapkv', 'adakv'} <= set(condcomp.list_kv_policies())
True
"""

from condcomp.kv.adakv import AdaKV
from condcomp.kv.choose import build_kv_policy, kv_policy_of
from condcomp.kv.policy import KV_FULL, KV_MODE_NAMES, KV_NONE, KV_WINDOW, DropKV, FullKV, KVPolicy
from condcomp.kv.position_bias import RelativeBias
from condcomp.kv.selection import HeldPlan, KVSelection, RequestPlan, as_kv_policy, decision_mask, pad_slots, select_kv
from condcomp.kv.snapkv import SnapKV, SnapState
from condcomp.kv.window import StreamWindow, WindowCache
from condcomp.kv.window_policy import WindowKV
from condcomp.kv.window_quant import QuantizedWindowCache, WindowCodec

__all__ = ["AdaKV", "KV_FULL", "KV_MODE_NAMES", "KV_NONE", "KV_WINDOW", "DropKV", "FullKV", "HeldPlan", "KVPolicy",
           "KVSelection", "QuantizedWindowCache", "RelativeBias", "RequestPlan", "SnapKV", "SnapState", "StreamWindow",
           "WindowCache", "WindowCodec", "WindowKV", "as_kv_policy", "build_kv_policy", "decision_mask", "kv_policy_of",
           "pad_slots", "select_kv"]
