"""``generate(use_cache=False)`` on a wrapped decoder: refused where its text would differ from generating with a
cache (a plan decided again at every step, or groups a KV policy holds that exist only in a cache)."""

from __future__ import annotations

from typing import Any

from torch.nn import Module

from condcomp.kv.choose import kv_policy_of
from condcomp.types import HeadPlan

from .internals import generate_on_stack


def _inside_generate(routed: Any) -> bool:
    """Whether a ``generate()`` of the model holding ``routed`` is on the call stack (a cache-free forward of this
    model inside another model's ``generate``, e.g. a scoring model in a logits processor, is not its generation)."""
    return generate_on_stack(lambda owner: isinstance(owner, Module) and any(m is routed for m in owner.modules()))


def check_cache_free_generation(routed: Any, plan: HeadPlan) -> None:
    """``generate(use_cache=False)`` would decide a decoder's plan again at every step from the prompt *and* the
    text generated so far (different tokens from generating with a cache): refused, with the fix, unless the plan
    is decided from the prompt (``plan_from_prompt``) or keeps every head."""
    policy = kv_policy_of(routed)
    streams = policy.needs_cache
    if routed.training or (routed.prompt_len is not None and not streams) or bool(plan.active.all()):
        return
    if not _inside_generate(routed):
        return
    if streams:
        raise ValueError(
            f"generate(use_cache=False) with the KV policy {policy.name!r}, which keeps (e.g. streams) the key/value "
            "groups a plan does not keep: those exist only in a KV cache (without one their heads would be skipped, "
            "a different text). Generate with the cache (the default)")
    raise ValueError(
        "generate(use_cache=False) with per-request plans: without a KV cache every step would decide the plan again "
        "from the prompt and the tokens generated so far, so the text would differ from generate() with a cache. "
        "Generate with the cache (the default), or decide every step's plan from the prompt: "
        "`with condcomp.plan_from_prompt(model, input_ids.shape[1]): model.generate(..., use_cache=False)` "
        "(the same tokens as with a cache)")
