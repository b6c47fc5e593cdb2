"""Which KV policy a wrapped layer's unkept groups get: ``CondCompConfig(kv=...)``, or the ``topk`` router's
deprecated ``stream_window`` shorthand (the ``window`` policy)."""

from __future__ import annotations

from typing import Any

from condcomp.kv.policy import DropKV, KVPolicy
from condcomp.kv.window import StreamWindow
from condcomp.kv.window_policy import WindowKV
from condcomp.registry import KV_POLICIES, ROUTERS

_ATTR = "_condcomp_kv_policy"  # the built policy, kept in the wrapped module's __dict__ (not a submodule)


def build_kv_policy(spec: tuple[str, dict[str, Any]]) -> KVPolicy:
    """The policy a normalized ``kv=`` spec names (``("window", {"sinks": 4, "window": 64})``)."""
    policy = KV_POLICIES.build(spec[0], spec[1], {})
    if not isinstance(policy, KVPolicy):
        raise TypeError(f"kv policy {spec[0]!r} built a {type(policy).__name__}, not a condcomp.kv.KVPolicy "
                        "subclass: derive the registered class from KVPolicy")
    return policy


def check_kv_support(config: Any, modules: list[tuple[str, Any]], attachment: str = "apply_") -> None:
    """Refuse, before anything is wrapped, a config whose KV policy keeps the groups a plan does not keep (``full``,
    ``window``, the router's ``stream_window``, a policy of one's own) on modules whose adapter cannot hold it:
    ``modules`` are ``(name, adapter class or None)``; adapters that can set ``holds_kv_policies = True``, or to
    the ``KVPolicy.stores`` kinds they hold (``("none", "full")``: not a state of the policy's own); one that sets
    ``adds_position_bias`` (T5) holds a policy's own state only if the policy reads it (``reads_position_bias``)."""
    stream = config.router[1].get("stream_window") is not None
    policy = build_kv_policy(config.kv)
    if not (stream or policy.needs_cache):
        return
    what = "the router's stream_window" if stream else f"kv={config.kv[0]!r}"
    router = config.router[0]
    if getattr(ROUTERS.get(router), "granularity", "sequence") == "token":
        raise ValueError(
            f"{attachment}: {what} says what a request keeps of the key/value groups its plan does not keep, but "
            f"router {router!r} decides per token: any later token may read any head, so the KV cache holds every "
            "key/value head and the KV policy would be silently ignored. Use a sequence router (topk, static, random) "
            "for a compact or streamed KV cache, or kv='drop' (the default) with this router")
    stores = "own" if stream else policy.stores

    def holds(adapter: Any) -> bool:
        kinds = getattr(adapter, "holds_kv_policies", False)
        if stores == "own" and getattr(adapter, "adds_position_bias", False) and not stream and not getattr(
                policy, "reads_position_bias", False):  # T5: the policy's own groups must add the position bias
            return False
        return kinds is True or (isinstance(kinds, tuple) and stores in kinds)

    unable = [name for name, adapter in modules if not holds(adapter)]
    if unable:
        kinds = sorted({str(getattr(a, "__name__", a)) for name, a in modules if a is not None and name in unable})
        where = f" ({', '.join(kinds)})" if kinds else ""
        raise ValueError(
            f"{attachment}: {what} keeps key/value groups a plan does not keep in a compact KV cache, which only the "
            "module swap of the Llama-family decoders (LlamaAttention, Qwen2/3, Mistral, Gemma), GPT-2 and BERT as "
            "a decoder holds (T5's decoder: a policy with a state of its own must add the position bias, "
            f"reads_position_bias); {unable[:3]}{' ...' if len(unable) > 3 else ''}{where} would cache every head "
            "and silently drop those groups instead. Use kv='drop' (the default) here, or condcomp.apply_ on such "
            "a decoder")


def kv_policy_of(routed: Any) -> KVPolicy:
    """The KV policy of a wrapped layer (built once from the config it was wrapped with)."""
    cached = routed.__dict__.get(_ATTR)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    config = getattr(routed, "condcomp_config", None)
    spec: tuple[str, dict[str, Any]] = getattr(config, "kv", None) or ("drop", {})
    policy = build_kv_policy(spec)
    stream = getattr(routed.condcomp_router, "stream", None)  # topk(stream_window=...): the window shorthand
    if isinstance(stream, StreamWindow):
        if not isinstance(policy, DropKV):
            raise ValueError(f"the router's stream_window and kv={spec[0]!r} both say what unkept groups keep: "
                             "set kv=('window', {'sinks': s, 'window': n}) and drop the router's stream_window")
        policy = WindowKV(stream.sinks, stream.window)
    layout = getattr(getattr(routed, "adapter", None), "layout", None)
    if layout is not None:
        policy.check_layout(layout.num_kv_heads)
    routed.__dict__[_ATTR] = policy
    return policy


def check_token_plan(routed: Any, plan: Any) -> None:
    """Refuse a per-token plan at inference on a cached call of a layer whose KV policy holds the groups a plan
    does not keep (a per-token budget, ``fixed(per_token=True)``, under a sequence router): such a plan caches
    every key/value head, so the policy would be silently ignored."""
    if plan.granularity == "sequence" or routed.training or not kv_policy_of(routed).needs_cache:
        return
    raise ValueError(
        f"kv={kv_policy_of(routed).name!r} says what a request keeps of the key/value groups its plan does not keep, "
        "but this call's plan is per token (a per-token budget, e.g. fixed(per_token=True)): any later token may "
        "read any head, so the KV cache holds every key/value head and the KV policy would be ignored. Use a "
        "per-sequence budget with it, or kv='drop' (the default)")
