"""Model-level entry points: apply_ / remove_, set_progress, aux_loss, head_usage."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from condcomp.adapters import find_adapter, load_integrations_for, supported_classes
from condcomp.config import CondCompConfig
from condcomp.host import RoutingHost, check_budget_fraction, check_progress
from condcomp.kv.choose import check_kv_support
from condcomp.kv.selection import RequestPlan
from condcomp.notices import Notices
from condcomp.record import store_record_in_config
from condcomp.registry import POLICIES
from condcomp.routed import RoutedAttention, layer_facts, wrap_module
from condcomp.types import HeadUsage


def matches_pattern(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches a target pattern: ``"re:<regex>"`` (full match), ``".suffix"``, or a name
    (that module, or one whose name ends with ``"." + name``, as in PEFT)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if pattern.startswith("."):
        return name.endswith(pattern)
    return name == pattern or name.endswith("." + pattern)


def _did_you_mean(pattern: str, names: list[str]) -> str:
    stem = pattern.removeprefix("re:").lstrip(".")
    close = difflib.get_close_matches(stem, names, n=3, cutoff=0.5)
    close += [n for n in difflib.get_close_matches(stem, [n.rsplit(".", 1)[-1] for n in names], n=3, cutoff=0.5)
              if n not in close]
    return f"; did you mean {close}?" if close else ""


def select_targets(names: list[str], config: CondCompConfig) -> list[str]:
    """The module ``names`` that ``config.target_modules`` selects (all when None) and ``exclude_modules`` does not:
    the one target matcher of both attachments (module swap and attention function)."""
    targets, excludes = config.target_modules, config.exclude_modules
    return [n for n in names
            if (targets is None or any(matches_pattern(n, p) for p in targets))
            and not (excludes and any(matches_pattern(n, p) for p in excludes))]


def apply_(model: nn.Module, config: CondCompConfig | None = None) -> list[str]:
    """Wrap the attention modules of ``model`` in place; returns the wrapped module names.

    >>> import condcomp
    >>> layer = nn.TransformerEncoderLayer(32, 4, batch_first=True)
    >>> condcomp.apply_(layer, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random"))
    ['self_attn']
    """
    config = config or CondCompConfig()
    load_integrations_for(model)
    if isinstance(model, RoutedAttention):
        raise ValueError("model is already a RoutedAttention; call condcomp.remove_ on its parent first")
    # Layers wrapped by an earlier apply_ stay as they are: applying again to other targets is how layers get
    # different routers (a different K per layer, say).
    wrapped = list(routed_modules(model))
    candidates = _attention_candidates(model, wrapped)
    _check_target_patterns(model, config, candidates, wrapped)
    chosen = select_targets(candidates, config)
    _check_chosen(model, config, chosen, candidates, wrapped)
    check_kv_support(config, [(n, find_adapter(model.get_submodule(n))) for n in chosen])
    built = _build_wrappers(model, config, chosen, keep_preparation=bool(wrapped))
    for name, routed in built.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, routed)
    store_record_in_config(model)  # a transformers model's save_pretrained then writes how to rebuild it
    return chosen


def _attention_candidates(model: nn.Module, wrapped: list[str]) -> list[str]:
    """Names of the modules some adapter matches, outermost first: one per attention layer, none inside a layer
    already wrapped."""
    candidates: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") or c == "" for c in candidates + wrapped):
            continue  # inside a module already chosen: one wrapped module per attention layer
        if find_adapter(module) is not None:
            candidates.append(name)
    return candidates


def _check_target_patterns(model: nn.Module, config: CondCompConfig, candidates: list[str],
                           wrapped: list[str]) -> None:
    """Refuse a ``target_modules`` pattern that is a typo, selects a wrapped layer, or only unsupported modules."""
    targets = config.target_modules
    for pattern in targets or ():
        hits = [n for n, _ in model.named_modules() if matches_pattern(n, pattern)]
        if not hits and len(targets or ()) > 1:  # (one pattern matching nothing is the error below, with a list)
            raise ValueError(f"target {pattern!r} matches no module (a typo?); attention modules that would "
                             f"match: {candidates[:6]}{_did_you_mean(pattern, candidates + wrapped)}")
        again = [n for n in hits if n in wrapped]
        if again:
            raise ValueError(f"target {pattern!r} matches modules that are already wrapped: {again}; "
                             "call condcomp.remove_(model) first to change their routing")
        # A pattern that selects some attention module may also match other modules (a broad regex);
        # one that selects none but matches other modules is a mistake worth naming.
        unsupported = [n for n in hits if n not in candidates and not any(n.startswith(w + ".") for w in wrapped)]
        if unsupported and not any(n in candidates for n in hits):
            kinds = {n: type(model.get_submodule(n)).__qualname__ for n in unsupported}
            raise ValueError(f"target {pattern!r} matches modules that are not supported attention modules: "
                             f"{kinds}; supported classes: {', '.join(supported_classes())}")


def _check_chosen(model: nn.Module, config: CondCompConfig, chosen: list[str], candidates: list[str],
                  wrapped: list[str]) -> None:
    """Refuse an empty choice (saying what the model holds), the model itself, and a shared policy over layers of
    different head counts."""
    targets, excludes = config.target_modules, config.exclude_modules
    if not chosen and wrapped and targets is None:
        raise ValueError(f"every supported attention module is already wrapped ({len(wrapped)}: {wrapped[:3]}...); "
                         "call condcomp.remove_(model) first to change the routing")
    if not chosen:
        seen = sorted({f"{n or '<root>'} ({type(m).__qualname__})" for n, m in model.named_modules()
                       if "attention" in type(m).__name__.lower() or "attn" in n.split(".")[-1].lower()})
        hint = _did_you_mean(targets[0], candidates) if targets else ""
        raise ValueError("apply_ matched no attention module. Attention-like modules in the model: "
                         f"{seen or 'none'}; supported classes: {', '.join(supported_classes())}; "
                         f"target_modules={targets}, exclude_modules={excludes}{hint}. A module of another class "
                         "can be supported with an AttentionAdapter (docs/extending.md)")
    if config.share_policy:
        # A shared budget's k is computed for one head count; another count would silently get the wrong k.
        heads = {n: _head_count(model.get_submodule(n)) for n in chosen}
        if len(set(heads.values())) > 1:
            raise ValueError(f"share_policy=True needs the same number of heads in every wrapped layer, got {heads}; "
                             "share it among layers of one size (target_modules) or set share_policy=False")
    if "" in chosen:
        raise ValueError("the model itself is an attention module: use condcomp.RoutedAttention.wrap(model, cfg)")


def _head_count(module: nn.Module) -> int:
    adapter_cls = find_adapter(module)
    assert adapter_cls is not None
    return adapter_cls(module).layout.num_heads


def _build_wrappers(model: nn.Module, config: CondCompConfig, chosen: list[str],
                    keep_preparation: bool) -> dict[str, RoutedAttention]:
    """A RoutedAttention for every chosen module, each built before the first swap: a module that cannot be wrapped
    (an unsupported option, a bad component option) leaves the model exactly as it was, not half converted.
    ``keep_preparation``: an earlier apply_ prepared the model, which must survive this call's failure."""
    adapter_classes = {find_adapter(model.get_submodule(n)) for n in chosen}
    for adapter_cls in adapter_classes:
        assert adapter_cls is not None
        adapter_cls.prepare(model)
    try:
        shared = None
        if config.share_policy:
            first = model.get_submodule(chosen[0])
            adapter_cls = find_adapter(first)
            assert adapter_cls is not None
            shared = POLICIES.build(config.policy[0], config.policy[1], layer_facts(adapter_cls(first)))
        notices = Notices()  # the layers share it: each warning once per model, not once per layer
        return {name: wrap_module(model.get_submodule(name), config, shared, name, notices) for name in chosen}
    except Exception:
        if not keep_preparation:
            for adapter_cls in adapter_classes:
                assert adapter_cls is not None
                adapter_cls.restore(model)
        raise


def routed_modules(model: nn.Module) -> dict[str, RoutedAttention]:
    """Every RoutedAttention in ``model`` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, RoutedAttention)}


def remove_(model: nn.Module) -> list[str]:
    """Put every original attention module back (with any parameter the wrapper received since)."""
    found = routed_modules(model)
    if not found:
        if routing_hosts(model):
            raise ValueError("remove_: the model is routed through transformers' AttentionInterface; undo it with "
                             "condcomp.integrations.hf.interface.remove_interface_(model)")
        raise ValueError("remove_: the model contains no RoutedAttention (was condcomp.apply_ called on it?)")
    for name, routed in found.items():
        base = routed.sync_base()
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, base)
    for adapter_cls in {type(r.adapter) for r in found.values()}:
        adapter_cls.restore(model)
    store_record_in_config(model)
    return list(found)


def routing_hosts(model: nn.Module) -> dict[str, RoutingHost]:
    """Every module holding condcomp routing, by name: the module swap's ``RoutedAttention`` modules and the
    attention-function attachment's ``condcomp_core`` children alike."""
    return {n: m for n, m in model.named_modules() if isinstance(m, RoutingHost)}


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every routed layer runs its original dense module, exactly (the same parameters and
    projections, the original forward): an A/B of dense vs routed without unwrapping.

    >>> with condcomp.disabled(model):  # doctest: +SKIP
    ...     dense_out = model(**batch)
    """
    with _hosts_set(model, "condcomp_disabled", True, "condcomp.disabled"):
        yield model


@dataclasses.dataclass(eq=False)
class _Block:
    """One open block of ``_hosts_set`` on one routing host: the attribute it set and the value its entry
    replaced (what its exit restores)."""

    attr: str
    replaced: object


# The thread inside blocks of _hosts_set on each routing host, and its open blocks there, innermost last.
_BLOCKS: weakref.WeakKeyDictionary[RoutingHost, tuple[int, list[_Block]]] = weakref.WeakKeyDictionary()
_BLOCKS_LOCK = threading.Lock()


@contextlib.contextmanager
def _hosts_set(model: nn.Module, attr: str, value: object, caller: str) -> Iterator[None]:
    """Set ``attr`` on every routing host of ``model`` for the block (to ``value``, or ``value(host)`` where it is
    callable: a per-layer value), then restore each host's own value.

    The setting is the model's, seen by every thread that calls it. Blocks nest within one thread and close in the
    reverse order they opened. A block entered while another thread is inside one on the same model is refused; a
    block that closes while one opened inside it is still open (generators or asyncio tasks holding blocks across
    their yields) is refused at its exit, after handing what its entry replaced to the open block, so the model
    still returns to its own setting when the last block closes."""
    hosts = list(routing_hosts(model).values())
    if not hosts:
        raise ValueError(f"{caller}: the model has no condcomp routing (was condcomp.apply_ called on it?)")
    me = threading.get_ident()
    opened: list[_Block] = []
    with _BLOCKS_LOCK:
        if any(_BLOCKS.get(h, (me, []))[0] != me for h in hosts):
            raise RuntimeError(
                f"{caller}: another thread is inside a condcomp.budget / disabled / plan_from_prompt block on this "
                "model. These blocks set the model's state, which every thread sees, so threads cannot hold "
                "different ones at once: serve concurrent requests of different settings with one model copy "
                "(copy.deepcopy) per setting, or one at a time")
        for h in hosts:
            block = _Block(attr, getattr(h, attr))
            _BLOCKS.setdefault(h, (me, []))[1].append(block)
            opened.append(block)
            setattr(h, attr, value(h) if callable(value) else value)
    try:
        yield
    finally:
        with _BLOCKS_LOCK:
            out_of_order = [_close_block(h, block) for h, block in zip(hosts, opened)]
        if any(out_of_order):
            raise RuntimeError(
                f"{caller}: this block closed while a condcomp.budget / disabled / plan_from_prompt block opened "
                "inside it on the same model is still open; blocks must close in the reverse order they opened. "
                "Blocks held open across generator yields or asyncio tasks interleave on one model, so what ran in "
                "this block after the other opened ran at the other's setting. Close them in order, or give each "
                "concurrent stream its own model copy (copy.deepcopy). The open block keeps its setting; the model "
                "returns to its own when that block closes")


def _close_block(host: RoutingHost, block: _Block) -> bool:
    """Remove ``block`` from ``host``'s open blocks and restore what its entry replaced; True when a block opened
    after it is still open (an out-of-order exit). Then the next such block of the same attribute takes over the
    value to restore, and the attribute keeps that block's setting."""
    stack = _BLOCKS[host][1]
    at = next(i for i, b in enumerate(stack) if b is block)
    later = stack[at + 1:]
    heir = next((b for b in later if b.attr == block.attr), None)
    if heir is None:
        setattr(host, block.attr, block.replaced)
    else:
        heir.replaced = block.replaced
    del stack[at]
    if not stack:
        del _BLOCKS[host]
    return bool(later)


def set_progress(model: nn.Module, progress: float) -> None:
    """Step every schedule (temperature, noise, entropy coefficient) to training progress in [0, 1].

    The progress is saved with the model (``state_dict``, checkpoints), so a resumed run continues its schedules.
    """
    p = check_progress(progress)
    stepped: set[int] = set()  # a policy shared by every layer is stepped once
    for host in routing_hosts(model).values():
        host.set_progress(p, stepped)


def aux_loss(model: nn.Module) -> Tensor:
    """Sum of the last forward's (already weighted) auxiliary losses; a zero tensor when there are none."""
    total: Tensor | None = None
    for host in routing_hosts(model).values():
        for value in host.aux_losses().values():
            total = value if total is None else total + value
    if total is None:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else None)
    return total


def head_usage(model: nn.Module) -> dict[str, HeadUsage]:
    """Per routed layer: ``HeadUsage(s_mean, k_frac, flop_frac)`` of the last forward."""
    out = {}
    for name, host in routing_hosts(model).items():
        usage = host.head_usage()
        if usage is not None:
            out[name] = usage
    return out


@contextlib.contextmanager
def plan_from_prompt(model: nn.Module, prompt_len: int) -> Iterator[nn.Module]:
    """Inside this block, every wrapped layer of ``model`` decides its sequence plans from the first
    ``prompt_len`` positions of each row only (the prompt), as a held plan is decided at inference.

    Use it to train or evaluate a causal LM under per-request plans without letting the plan see the
    continuation: put the loss on positions ``>= prompt_len``. Per-token plans (MoH) are unaffected: each token
    is routed from itself. With left padding, ``prompt_len`` counts the padding (the padded prompt width). With a
    KV cache a held plan is decided at the request's first call, from at most ``prompt_len`` of its positions: a
    chunked prefill (``generate(prefill_chunk_size=...)``) decides it from its first chunk only. A first call of the
    whole width holds the whole prompt, so under ``kv='snapkv'`` / ``'adakv'`` a call of several tokens (a question,
    a new turn) may follow it; without this block such a call right after the prefill is refused (a second chunk?).

    >>> import condcomp
    >>> model = nn.Sequential(condcomp.HeadAttention(16, 4, causal=True))
    >>> _ = condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5})))
    >>> with condcomp.plan_from_prompt(model, 3):
    ...     y = model(torch.randn(2, 8, 16))
    """
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be a positive int (the padded prompt width), got {prompt_len!r}")
    with _hosts_set(model, "prompt_len", prompt_len, "condcomp.plan_from_prompt"):
        yield model


@contextlib.contextmanager
def budget(model: nn.Module, fraction: float) -> Iterator[nn.Module]:
    """Inside this block every wrapped layer of ``model`` gives each row the fraction ``fraction`` of its heads,
    whatever its policy would choose (same rounding and ``k_min``): a per-call budget without rebuilding the wrap.

    A causal LM's request keeps the plan decided at its prefill (it lives in the KV cache), so the budget of the
    block in which a request starts is the request's: ``with condcomp.budget(model, 0.5): model.generate(...)``.
    The policy's auxiliary losses are not computed inside the block. The budget is the model's, not the caller's:
    blocks nest and must close in the reverse order they opened (a block that closes while one opened inside it
    is still open, as generators or asyncio tasks holding blocks across their yields do, raises a RuntimeError);
    give each concurrent stream of requests its own model copy. A fraction below a router's shared heads is refused.

    >>> import condcomp
    >>> model = nn.Sequential(condcomp.HeadAttention(16, 4))
    >>> _ = condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="topk"))
    >>> with condcomp.budget(model.eval(), 0.5):
    ...     y = model(torch.randn(2, 5, 16))
    >>> condcomp.head_usage(model)["0"].k_frac
    0.5
    """
    check_budget_fraction(routing_hosts(model), fraction)
    with _hosts_set(model, "budget_fraction", float(fraction), "condcomp.budget"), \
            _hosts_set(model, "budget_cap", lambda host: host.budget_cap_of(float(fraction)), "condcomp.budget"):
        yield model


def request_plans(model: nn.Module, cache: object) -> dict[str, RequestPlan]:
    """What each request of ``cache`` (a transformers KV cache the wrapped ``model`` filled) keeps, per wrapped
    layer: ``{name: RequestPlan}`` with ``heads (B, H)`` and ``kv_groups (B, Hkv)`` bool tensors and
    ``kept_heads()`` / ``kept_kv_groups()`` lists per row. Layers whose plan is per token (every head cached) or
    that hold no plan for this cache are left out.

    >>> out = model.generate(**batch, return_dict_in_generate=True)  # doctest: +SKIP
    >>> plans = condcomp.request_plans(model, out.cache)  # doctest: +SKIP
    >>> plans["model.layers.0.self_attn"].kept_kv_groups()  # doctest: +SKIP
    [[0, 2], [1, 2]]
    """
    if not (hasattr(cache, "layers") or hasattr(cache, "self_attention_cache")):
        raise TypeError(f"condcomp.request_plans: expected the transformers KV cache a generate() or forward call "
                        f"filled (e.g. `out.cache` of generate(..., return_dict_in_generate=True)), got "
                        f"{type(cache).__name__}")
    out = {}
    for name, host in routing_hosts(model).items():
        record = host.adapter.held_record(cache) if hasattr(host.adapter, "held_record") else None
        if record is None:
            continue
        L = host.layout
        if record.plan.num_heads != L.num_heads or record.num_kv_heads != L.num_kv_heads:
            raise ValueError(f"condcomp.request_plans: layer {name} has {L.num_heads} heads / {L.num_kv_heads} "
                             f"key/value heads, but the cache holds a plan for {record.plan.num_heads} / "
                             f"{record.num_kv_heads}: it was filled by another model; pass the model that filled it")
        out[name] = RequestPlan.of(record)
    return out
