"""What a user can do about KV-cache memory, as the variants of ``condcomp bench kv``.

A variant is two choices: the **model** that fills the cache (the dense model, or one wrapped by condcomp so that
its cache holds only some key/value groups) and the **cache** that stores what it writes (transformers' own
``DynamicCache``, or a ``QuantizedCache``). Adding a variant is one :data:`VARIANTS` entry, plus one
:data:`MODELS` entry when it needs a new way of wrapping the model.

The prefill of a prompt is shared by every variant of one model: a ``QuantizedCache`` attends the prompt with the
exact keys and quantizes them as it stores them (transformers' ``QuantizedLayer`` / ``Fp8QuantizedLayer``
return the states they were given on their first update), so quantizing the keys of a prefill made into a plain
cache gives the same cache state as prefilling into the quantized cache (:func:`cache_from_prefill`; the tests
compare both).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# Tensors a transformers cache layer holds for keys and values: full-precision (dense layers; a quantized layer's
# residual window) and quantized (with their scales and zero points).


@dataclass(frozen=True)
class KVVariant:
    """``model``: a :data:`MODELS` key; ``cache``: a :data:`CACHES` key, None for the model's own dynamic cache."""

    model: str
    cache: str | None = None
    note: str = ""


# Quantized caches: (transformers backend, its options, the packages it needs beyond transformers).
CACHES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "fp8": ("fp8", {}, ()),
    "hqq4": ("hqq", {"nbits": 4}, ("hqq", "termcolor")),
}

VARIANTS: dict[str, KVVariant] = {
    "dense": KVVariant("dense", note="the model as loaded, transformers' dynamic cache"),
    "quantized-fp8": KVVariant("dense", "fp8", note="QuantizedCache, fp8 (e4m3) per tensor"),
    "quantized-hqq4": KVVariant("dense", "hqq4", note="QuantizedCache, HQQ 4-bit, groups of 64, 128 recent tokens "
                                                      "in full precision"),
    "drop-keep2of3": KVVariant("static-2of3", note="condcomp static split: 2 of 3 KV groups per layer, ranked by "
                                                   "gradient importance; the cache holds only those"),
    "drop-keep1of3": KVVariant("static-1of3", note="condcomp static split: 1 of 3 KV groups per layer"),
    "drop-keep2of3+fp8": KVVariant("static-2of3", "fp8", note="the static 2-of-3 split inside an fp8 QuantizedCache"),
    "drop-keep1of3+hqq4": KVVariant("static-1of3", "hqq4", note="the static 1-of-3 split inside a 4-bit cache"),
    "split-static-1of3": KVVariant("window-1of3-w252", note="condcomp static split: 1 of 3 KV groups per layer in "
                                                            "full (static pruning's ranking), the others a streaming "
                                                            "window of 4 sink + 252 recent tokens"),
    "split-static-1of3+fp8": KVVariant("window-1of3-w252", "fp8", note="the static full/window split inside an "
                                       "fp8 QuantizedCache: full groups and windows in fp8"),
    "split-static-1of3+hqq4": KVVariant("window-1of3-w252", "hqq4", note="the static full/window split inside a "
                                        "4-bit cache: full groups HQQ 4-bit, windows 4-bit per token"),
    "streaming": KVVariant("window-all-w252", note="StreamingLLM: every KV group keeps 4 sink + 252 recent tokens"),
    "split-duo-1of3": KVVariant("duo-1of3-w252", note="condcomp static split from DuoAttention gates "
                                                      "(results/kv/duo_gates.json, condcomp calibrate-kv): the "
                                                      "highest third of all (layer, group) gates in full, layers may "
                                                      "differ; the others 4 sink + 252 recent tokens"),
    "streaming+hqq4": KVVariant("window-all-w252", "hqq4", note="StreamingLLM inside a 4-bit cache: windows 4-bit "
                                "per token"),
    "split-duo-1of3+fp8": KVVariant("duo-1of3-w252", "fp8", note="the DuoAttention split inside an fp8 "
                                    "QuantizedCache"),
    "split-duo-1of3+hqq4": KVVariant("duo-1of3-w252", "hqq4", note="the DuoAttention split inside a 4-bit cache"),
    "split-duo-1of3-seed1": KVVariant("duo-1of3-w252-seed1", note="the DuoAttention split from the gates of "
                                      "training seed 1 (results/kv/duo_gates_seed1.json)"),
    "split-duo-1of6-w92": KVVariant("duo-1of6-w92", note="condcomp static split from DuoAttention gates: the "
                                    "highest sixth of all (layer, group) gates in full, the others 4 sink + 92 "
                                    "recent tokens (about a quarter of the bytes at 1024 tokens)"),
    "split-request-1of3": KVVariant("request-1of3-w252", note="condcomp per-request split: a trained topk router "
                                    "per layer (results/kv/request_router_seed0.pt, condcomp calibrate-kv --method "
                                    "request) keeps 1 of 3 KV groups in full, chosen from each prompt; the others 4 "
                                    "sink + 252 recent tokens"),
    "split-request-1of3+fp8": KVVariant("request-1of3-w252", "fp8", note="the per-request split inside an fp8 "
                                        "QuantizedCache"),
    "split-request-1of3-seed1": KVVariant("request-1of3-w252-seed1", note="the per-request split with the routers "
                                          "of training seed 1 (results/kv/request_router_seed1.pt)"),
    "router-keep2of3": KVVariant("router-2of3", note="condcomp per-request plan, untrained topk router: 2 of 3 "
                                                     "KV groups chosen from the prompt"),
}
for _frac in (0.5, 0.25):  # token selection in every KV group, at kvpress's SnapKV / AdaKV press settings
    VARIANTS[f"snapkv-{_frac:.2f}"] = KVVariant(
        f"snapkv-{_frac:.2f}", note=f"condcomp kv='snapkv' in every KV group: {_frac:.2f} of each prompt's tokens "
        "(SnapKV's scores from the last 64 prompt queries, pooled over 5), the evicted tokens freed")
    VARIANTS[f"adakv-{_frac:.2f}"] = KVVariant(
        f"adakv-{_frac:.2f}", note=f"condcomp kv='adakv' in every KV group: {_frac:.2f} of each prompt's tokens per "
        "group on average, shared over a layer's groups by SnapKV's scores (each group at least 0.2 of its share), "
        "stored padded to the layer's largest group")
for _frac in (0.5, 0.25):  # per-group budgets (HeadKV) from the DuoAttention gates, one byte budget
    VARIANTS[f"headkv-{_frac:.2f}"] = KVVariant(
        f"headkv-duo-{_frac:.2f}", note=f"condcomp per-group budgets (condcomp.kv.headkv_budget): {_frac:.2f} of the "
        "dense cache's bytes allocated over every (layer, KV group) by the DuoAttention gates (results/kv/"
        "duo_gates.json), each group 1/32 of the prompt plus a pool in proportion to its gate above the smallest; "
        "groups that reach the whole prompt full, the others kv='headkv' (4 sinks, 64 recent, the rest by SnapKV's "
        "scores from the last 64 queries, pooled over 5), padded to the layer's largest")
    VARIANTS[f"headkv-window-{_frac:.2f}"] = KVVariant(
        f"headkv-window-duo-{_frac:.2f}", note=f"as headkv-{_frac:.2f}, each group's tokens beyond its 4 sinks the "
        "most recent ones (kv='headkv', select='window'): per-group windows, no selection")
VARIANTS["headkv-0.25-full1of6"] = KVVariant("headkv-duo-0.25-full1of6", note="as headkv-0.25, the sixth of the "
                                             "(layer, KV group) pairs with the highest gates kept in full first, the "
                                             "rest of the budget shared over the others by the same rule (full=1/6)")
# DuoAttention gates trained at 1024 tokens on calibrate-kv --mix's rows (train split, other wordings), two seeds
VARIANTS.update({
    "split-duo1024-1of3": KVVariant("duomix1024-1of3-w252", note="condcomp static split from DuoAttention gates "
                                    "trained at 1024 tokens on the calibration mixture "
                                    "(results/kv/duo_gates_mix1024_seed0.json): the highest third in full, the "
                                    "others 4 sink + 252 recent tokens"),
    "split-duo1024-1of3-seed1": KVVariant("duomix1024-1of3-w252-seed1", note="the same from training seed 1 "
                                          "(results/kv/duo_gates_mix1024_seed1.json)"),
    "split-duo1024-1of6-w92": KVVariant("duomix1024-1of6-w92", note="the 1024-token mixture gates' highest sixth "
                                        "in full, the others 4 sink + 92 recent tokens"),
})
DEFAULT_VARIANTS = ("dense", "quantized-fp8", "quantized-hqq4", "drop-keep2of3", "drop-keep1of3",
                    "drop-keep2of3+fp8")
# Variants still to build (listed under the table): none at present.
PLANNED_VARIANTS: tuple[str, ...] = ()


SPLIT_GRAMMAR = ("split-duo-<a>of<b>-w<W>[+fp8|+hqq4]: the fraction a/b (0 < a < b, in lowest terms) of all "
                 "(layer, KV group) pairs with the highest gates of results/kv/duo_gates.json kept in full, the "
                 "others 4 sinks + W recent tokens (W >= 1), optionally inside the fp8 or HQQ 4-bit cache; e.g. "
                 "split-duo-1of2-w124+fp8")
_SPLIT_NAME = re.compile(r"split-duo-(?P<a>[0-9]+)of(?P<b>[0-9]+)-w(?P<w>[0-9]+)(?:\+(?P<cache>[a-z0-9]+))?")


def split_variant(name: str) -> KVVariant | None:
    """The variant a name of :data:`SPLIT_GRAMMAR` means (its model added to :data:`MODELS`), or None for a name
    outside the ``split-duo-`` family. A ``split-duo-`` name that is not a table entry and breaks the grammar raises
    a ValueError quoting it. The table's own names (``split-duo-1of3``: windows of 252) keep their meaning.

    >>> v = split_variant("split-duo-1of2-w124+fp8")
    >>> v.model, v.cache
    ('duo-1of2-w124', 'fp8')
    """
    if name in VARIANTS or not name.startswith("split-duo-"):
        return VARIANTS.get(name)
    m = _SPLIT_NAME.fullmatch(name)
    a, b, w = (int(m[k]) for k in "abw") if m else (0, 0, 0)
    why = ("it does not read as the grammar" if m is None else
           "the fraction must be 0 < a < b" if not 0 < a < b else
           f"write the fraction in lowest terms (split-duo-{a // math.gcd(a, b)}of{b // math.gcd(a, b)}-w{w}...)"
           if math.gcd(a, b) != 1 else "the window W must be at least 1" if w < 1 else
           f"the cache must be fp8 or hqq4, got +{m['cache']}" if m["cache"] not in (None, *CACHES) else "")
    if why:
        raise ValueError(f"kv variant {name!r}: {why}; a split is named {SPLIT_GRAMMAR}")
    assert m is not None
    key = f"duo-{a}of{b}-w{w}"
    MODELS.setdefault(key, gate_split(DUO_GATES, a / b, w))
    cache = m["cache"]
    quantized = {"fp8": ", inside an fp8 QuantizedCache", "hqq4": ", inside a 4-bit (HQQ) cache"}.get(cache or "", "")
    return KVVariant(key, cache, note=f"condcomp static split from DuoAttention gates ({DUO_GATES}): the "
                     f"{a}/{b} of all (layer, group) pairs with the highest gates in full, the others 4 sink + {w} "
                     f"recent tokens{quantized}")


def add_split_variants(names: list[str]) -> None:
    """Add every name of :data:`SPLIT_GRAMMAR` among ``names`` to :data:`VARIANTS` (and its model to
    :data:`MODELS`); a malformed ``split-duo-`` name raises (:func:`split_variant`), other names are left."""
    for name in names:
        if name not in VARIANTS and (v := split_variant(name)) is not None:
            VARIANTS[name] = v


def check_names(names: list[str], timed: list[str] | None) -> None:
    """Refuse variant names no entry of :data:`VARIANTS` has, and ``--time-decode`` names the run does not measure
    (they would time nothing, without a word). Names of :data:`SPLIT_GRAMMAR` are added to the tables first."""
    add_split_variants([*names, *(timed or [])])
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown kv variant(s) {unknown}; choose from {', '.join(VARIANTS)}; or name a split "
                         f"{SPLIT_GRAMMAR}")
    untimed = [n for n in timed or [] if n not in names and n != "dense"]
    if untimed:
        raise ValueError(f"--time-decode names {untimed}, which this run does not measure (--variants: "
                         f"{', '.join(names)})")


def missing_packages(name: str) -> str | None:
    """Why variant ``name`` cannot run in this installation (a sentence), or None."""
    v = VARIANTS[name]
    if v.cache is None:
        return None
    needed = CACHES[v.cache][2]
    absent = [p for p in needed if importlib.util.find_spec(p) is None]
    if absent:
        return (f"{name} needs the package(s) {', '.join(absent)} for transformers' QuantizedCache: "
                'pip install -e ".[kvquant]"')
    return None


def quantized_cache(kind: str, config: Any) -> Any:
    """An empty transformers ``QuantizedCache`` of kind ``kind`` (a :data:`CACHES` key) for the model's config."""
    from transformers import QuantizedCache

    backend, options, _ = CACHES[kind]
    return QuantizedCache(backend, config, **options)


def cache_from_prefill(source: Any, kind: str | None, config: Any) -> Any:
    """The cache a prefill into variant cache ``kind`` would hold, from a prefill into a dynamic cache.

    ``None``: a deep copy (continuing a request grows it; ``source`` stays for the other variants). A quantized
    kind: a fresh ``QuantizedCache`` whose layers are given the prefill's keys and values, as the prefill would
    have given them; a condcomp plan held by a source layer moves with it (the compact cache's kept groups).
    """
    if kind is None:
        return copy.deepcopy(source)
    from condcomp.integrations.hf.cache import placeholder_width, store_windows, stored_windows
    from condcomp.integrations.hf.internals import layer_initialized
    from condcomp.kv import adopt

    target = quantized_cache(kind, config)
    planned = any(getattr(src, "condcomp_plan", None) is not None for src in source.layers)
    if planned:
        adopt(target)  # condcomp's cache layers, wrapping the quantized ones: they hold the plan
    for src, dst in zip(source.layers, target.layers):
        if not layer_initialized(src):
            continue
        keys, values = src.keys, src.values
        held = getattr(src, "condcomp_plan", None)
        if held is not None and held.selection is not None and held.selection.slots == 0:
            # no group kept in full: a token-counting placeholder, as wide as the target layer stores it
            B, _, T, _ = keys.shape
            keys = values = keys.new_zeros(*keys.shape[:-1], placeholder_width(dst, B, T, prefill=True))
        dst.update(keys, values)
        if held is not None:
            dst.condcomp_plan = held
            store_windows(dst, stored_windows(src))  # the streamed groups' windows, quantized as the layer's keys
    return target


def cache_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds: full-precision and quantized states with the quantizers'
    scales and zero points, and condcomp's streamed-group windows (each tensor counted once)."""
    from condcomp.integrations.hf.cache import cache_bytes as per_layer

    return sum(per_layer(cache))


# ---- the models -------------------------------------------------------------------------------------------------

Prepare = Callable[[nn.Module, "ModelContext"], nn.Module]


@dataclass
class ModelContext:
    """What preparing a model may need: the static split's group importance ``(L, G)`` (computed on demand)."""

    importance: Callable[[], Tensor]


def _kept(fraction: float, groups: int) -> int:
    return max(1, round(fraction * groups))


def static_split(fraction: float) -> Prepare:
    """Keep the fraction of each layer's KV groups that static pruning's importance ranks highest (a sequence
    plan held in the cache: the cache holds only those groups)."""
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        import condcomp
        from condcomp.kv.calibration import group_heads, keep_groups

        cfg: Any = getattr(dense, "config")  # noqa: B009
        H, G = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        groups = keep_groups(ctx.importance(), _kept(fraction, G))  # per layer, the kept groups
        model = copy.deepcopy(dense)
        layers = [name for name, _ in model.named_modules() if name.endswith("self_attn")]
        if len(layers) != len(groups):
            raise ValueError(f"the importance ranks {len(groups)} layers, the model has {len(layers)}")
        for layer, kept in zip(layers, groups):  # one static head set per layer
            condcomp.apply_(model, condcomp.CondCompConfig(policy="full", executor="auto", target_modules=[layer],
                                                           router=("static", {"heads": group_heads(kept, H, G)})))
        return model.eval()
    return prepare


def router_split(fraction: float) -> Prepare:
    """A per-request plan keeping the fraction of the KV groups, chosen by an untrained (seeded) topk router."""
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        import condcomp

        G = int(getattr(dense, "config").num_key_value_heads)  # noqa: B009
        model = copy.deepcopy(dense)
        torch.manual_seed(0)
        condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": _kept(fraction, G) / G}),
                                                       router=("topk", {"kv_groups": True}), executor="auto"))
        return model.eval()
    return prepare


def window_split(fraction: float, window: int, sinks: int = 4) -> Prepare:
    """Static pruning's ranking picks the fraction of each layer's KV groups kept in full; the other groups keep a
    streaming window (the first ``sinks`` and the last ``window`` tokens) instead of nothing. ``fraction`` 0 is
    StreamingLLM: every group windowed. The ranking is the ``topk`` router's warm start (its scorer starts at the
    scores, so an untrained router keeps the same groups for every request)."""
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        from condcomp.kv.calibration import static_split as window_static_split

        return window_static_split(copy.deepcopy(dense), ctx.importance(), fraction, window=window, sinks=sinks)
    return prepare


DUO_GATES = Path("results/kv/duo_gates.json")


def gate_split(path: Path, fraction: float, window: int, sinks: int = 4) -> Prepare:
    """A split from a gates file (``condcomp calibrate-kv``): the fraction of all (layer, KV group) pairs with the
    highest scores is kept in full (global over layers, as DuoAttention: a layer may keep none or all of its
    groups), the other groups stream (``sinks`` first + ``window`` last tokens). Built as one ``topk`` router per
    layer, warm-started from the gates with the layer's own kept count (every request gets the same split)."""
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        from condcomp.kv.calibration import duo_split

        return duo_split(copy.deepcopy(dense), path, fraction, window=window, sinks=sinks)
    return prepare


REQUEST_ROUTERS = (Path("results/kv/request_router_seed0.pt"), Path("results/kv/request_router_seed1.pt"))


def request_split(path: Path) -> Prepare:
    """The per-request full/window split of a router file (``condcomp calibrate-kv --method request``): per layer a
    ``topk`` router whose scorer is the file's picks, from each prompt, the KV groups kept in full (the file's
    ``keep`` per layer); the others stream (the file's sinks and window). The cache holds each request's own
    split."""
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        from condcomp.kv.calibration import request_split as apply_request_split

        return apply_request_split(copy.deepcopy(dense), path)
    return prepare


def group_budgets(path: Path, fraction: float, select: str = "snapkv", full: float = 0.0) -> Prepare:
    """Per-group budgets from a gates file within ``fraction`` of the dense cache's bytes
    (:func:`condcomp.kv.headkv_budget.headkv_split`, observation window 64 as the ``snapkv-*`` variants)."""
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        from condcomp.kv.headkv_budget import headkv_split

        return headkv_split(copy.deepcopy(dense), path, fraction, observe=64, pool=5, select=select, full=full)
    return prepare


def token_selection(kv: str, fraction: float) -> Prepare:
    """Every KV group of every layer held by KV policy ``kv`` (``snapkv``, ``adakv``) keeping ``fraction`` of each
    prompt's tokens, with kvpress's SnapKV press settings (observation window 64, pool 5): the plan keeps no group
    in full, so nothing is split and the policy is compared with kvpress's presses at the same fraction."""
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        import condcomp

        model = copy.deepcopy(dense)
        condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.0, "k_min": 0}),
                                                       router=("topk", {"kv_groups": True}),
                                                       kv=(kv, {"fraction": fraction, "observe": 64, "pool": 5})))
        return model.eval()
    return prepare


MODELS: dict[str, Prepare] = {
    "dense": lambda dense, ctx: dense,
    "static-2of3": static_split(2 / 3),
    "static-1of3": static_split(1 / 3),
    "router-2of3": router_split(2 / 3),
    "window-1of3-w252": window_split(1 / 3, 252),
    "window-all-w252": window_split(0, 252),
    "duo-1of3-w252": gate_split(DUO_GATES, 1 / 3, 252),
    "duo-1of6-w92": gate_split(DUO_GATES, 1 / 6, 92),
    "duo-1of3-w252-seed1": gate_split(Path("results/kv/duo_gates_seed1.json"), 1 / 3, 252),
    "request-1of3-w252": request_split(REQUEST_ROUTERS[0]),
    "request-1of3-w252-seed1": request_split(REQUEST_ROUTERS[1]),
    **{f"{kv}-{f:.2f}": token_selection(kv, f) for kv in ("snapkv", "adakv") for f in (0.5, 0.25)},
    **{f"headkv-duo-{f:.2f}": group_budgets(DUO_GATES, f) for f in (0.5, 0.25)},
    **{f"headkv-window-duo-{f:.2f}": group_budgets(DUO_GATES, f, "window") for f in (0.5, 0.25)},
    "headkv-duo-0.25-full1of6": group_budgets(DUO_GATES, 0.25, full=1 / 6),
}


MIX_GATES = tuple(Path(f"results/kv/duo_gates_mix1024_seed{s}.json") for s in (0, 1))
MODELS.update({
    "duomix1024-1of3-w252": gate_split(MIX_GATES[0], 1 / 3, 252),
    "duomix1024-1of3-w252-seed1": gate_split(MIX_GATES[1], 1 / 3, 252),
    "duomix1024-1of6-w92": gate_split(MIX_GATES[0], 1 / 6, 92),
})


def computed_importance(model: nn.Module, calibration: Tensor, prompt_len: int, batch_size: int = 4) -> Tensor:
    """Michel et al.'s gradient importance per KV group ``(L, G)`` on ``calibration`` rows (continuation loss after
    ``prompt_len`` tokens), as ``condcomp tune-llm`` computes static pruning's ranking."""
    from condcomp.kv.calibration import continuation_importance

    return continuation_importance(model, calibration, prompt_len, batch_size)
