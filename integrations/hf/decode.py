"""Per-request plans with a KV cache for projection-style decoders (Llama, Qwen2/3, Mistral, Gemma).

At inference with a cache, a sequence plan is decided once, at the request's prefill, and held for its later
calls (:mod:`condcomp.kv.selection`). The key/value heads the plan keeps are the only ones projected, cached and
read: the cache holds ``(B, g, S, Dh)`` with ``g`` the batch's largest number of kept KV groups, in the order of
:class:`~condcomp.kv.selection.KVSelection`. Query heads inside a kept group that the plan skips are computed with
gate 0 (at decode a group's cost is reading its keys and values, shared by its query heads); the output
projection reads the kept heads' outputs scattered back to their columns, so LoRA and biases behave as in the
module. At the full budget (every group kept, gates 1) nothing is gathered or scattered: this is dense attention.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import Tensor

from condcomp.executors.auto import get_executor
from condcomp.executors.cached import CompactKV, Projections
from condcomp.host import LastForward
from condcomp.kv.choose import kv_policy_of
from condcomp.kv.policy import KV_NONE
from condcomp.kv.selection import KVSelection, pad_slots, select_kv
from condcomp.kv.window import StreamWindow
from condcomp.kv.window_policy import WindowKV
from condcomp.plans import kv_groups_used
from condcomp.types import AttentionInputs, HeadPlan

from .cache import RequestStep, cache_layer, compact_write, store_windows, stored_windows
from .common import decoder_request_plan, mask_parts, sliding_window_bias

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


def decide_request_plan(routed: RoutedAttention, x: Tensor, mask: Any, step: RequestStep) -> HeadPlan:
    """The request's plan for this call: the one stored in the cache, or one decided now from the call's real
    tokens (at the request's first call; a sequence plan on a cache that holds tokens but no plan is refused)."""
    plan = decoder_request_plan(routed, step, x, mask)
    if step.held is None and plan.granularity == "sequence" and routed.last is not None:
        routed.last = replace(routed.last, executor="kv_cache")
    return plan


def stream_window(routed: RoutedAttention) -> StreamWindow | None:
    """The streaming window the groups a plan does not keep get (the ``window`` KV policy), or None."""
    policy = kv_policy_of(routed)
    return policy.window_spec if isinstance(policy, WindowKV) else None


def compact_selection(routed: RoutedAttention, plan: HeadPlan, step: RequestStep) -> KVSelection:
    """The slots of a plan decided now; a static cache layer allocated earlier fixes the slot count."""
    policy = kv_policy_of(routed)
    selection = select_kv(plan, routed.layout, policy)
    layer = cache_layer(step.cache, step.layer_idx)
    static = hasattr(layer, "max_cache_len") or type(step.cache).__name__.startswith("Static")
    if selection.window_index is not None and static:
        raise ValueError(f"the KV policy {policy.name!r} keeps the groups a plan does not keep in a state of its own "
                         "(streamed key/value groups: a trimmed window) beside the cache, which a static cache cannot "
                         "hold: generate with the default DynamicCache")
    slots = getattr(layer, "num_heads", None) if getattr(layer, "is_initialized", False) else None
    if isinstance(slots, int) and hasattr(layer, "max_cache_len"):  # static: (B, slots, max_len, Dh) allocated
        if selection.slots <= slots:
            return pad_slots(selection, slots)
        layer.is_initialized = False  # an empty static layer too small for this plan: allocated again
    return selection


def _strategy(sel: KVSelection) -> str:
    if sel.window_index is not None:
        name = sel.policy.name if sel.policy is not None else "window"
        return f"full+{name}" if sel.slots else name
    return "full" if sel.identity else "compact"


def held_attention(routed: RoutedAttention, sel: KVSelection, x: Tensor, rotary: tuple[Tensor, Tensor] | None,
                   step: RequestStep, mask: Any, sliding_window: int | None, extra: dict[str, Any]) -> Tensor:
    """One call under a request's plan: ``x (B, T, D)`` -> ``(B, T, D)``, run by the ``kv_cache`` executor; this
    only translates transformers' arguments (mask, cache, projections) into its call."""
    cache, layer_idx = step.cache, step.layer_idx
    L = routed.layout
    B, T, _ = x.shape
    if B == 0:  # an empty batch: nothing to attend, the cache still learns the call's length
        empty = x.new_zeros(B, 0, T, L.head_dim)
        with compact_write():
            cache.update(empty, empty, layer_idx, kwargs=extra)
        return x.new_zeros(B, T, L.d_model)
    S = mask.shape[-1] if isinstance(mask, Tensor) else step.query_start + T  # keys after this call's update
    query_mask, key_mask, bias = mask_parts(mask, B, T, S, True, step.query_start)
    if mask is None and sliding_window is not None and S > sliding_window:
        bias = sliding_window_bias(T, S, int(sliding_window), x.device, x.dtype)

    def store(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        with compact_write():
            return cache.update(k, v, layer_idx, kwargs=extra)  # type: ignore[no-any-return]

    def keep_windows(windows: Any) -> None:
        # looked up again: at a prefill the layer exists only once store() has run
        store_windows(cache_layer(cache, layer_idx), windows, sel.policy)  # read back by the request's next call

    layer = cache_layer(cache, layer_idx)
    windows = stored_windows(layer, sel.policy) if step.held is not None else None
    proj = Projections(routed.q_proj, routed.k_proj, routed.v_proj, routed.o_proj,  # the modules: exact for LoRA
                       getattr(routed, "q_norm", None), getattr(routed, "k_norm", None))
    compact = CompactKV(sel, store, S if mask is None else None, windows, keep_windows, proj)
    inputs = AttentionInputs(x=x, mask=query_mask, key_mask=key_mask, attn_bias=bias, rotary=rotary,
                             dropout_p=L.dropout_p if routed.training else 0.0)
    plan = step.held.plan if step.held is not None else (routed.last.plan if routed.last is not None else None)
    y = get_executor("kv_cache").run_cached(L, inputs, plan, compact)
    if plan is not None:  # head_usage reports this call (a decode step's T and keys), not the prefill's
        last = routed.last
        s = last.s if last is not None and tuple(last.s.shape) == (B,) else plan.counts.float() / plan.num_heads
        streamed = None
        if sel.modes is not None and kv_policy_of(routed).needs_cache:
            # (B, Hkv) -> (B, H): every head of a group the plan does not keep that its KV policy holds
            by_policy = (sel.modes != KV_NONE) & ~kv_groups_used(plan.active, sel.modes.shape[1])
            streamed = by_policy.repeat_interleave(plan.num_heads // sel.modes.shape[1], dim=1)
        routed.last = LastForward(s, plan, query_mask, T, S, "kv_cache", _strategy(sel), streamed,
                                  sel.window.capacity if sel.window is not None else S)
    return y  # type: ignore[no-any-return]
