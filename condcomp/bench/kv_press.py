"""kvpress's presses as ``condcomp bench kv`` variants, on transformers 5 (the optional ``kvpress`` extra).

kvpress 0.5.5 compresses the cache in a forward hook on every attention layer during the prefill; the hook reads
the attention call's ``past_key_values`` and ``cache_position`` keyword arguments. transformers 5.25 renamed the
first to ``cache`` and passes no ``cache_position`` (only ``position_ids``): :func:`kvpress_kwargs` gives the hook
the names it reads, and :func:`pressed` applies a press with that adapter. After an eviction press the cache holds
fewer tokens than the request has seen, so later tokens need their true positions (``position_ids``, as kvpress's
own pipeline passes them): :func:`true_positions`.

Variants (:data:`PRESS_VARIANTS`): token-eviction presses at KV fractions 0.5 and 0.25 (StreamingLLM, SnapKV,
ExpectedAttention, KNorm, TOVA; ``compression_ratio`` = 1 - fraction), and the head-wise AdaKV (SnapKV's scores)
and DuoAttention presses, which mask keys instead of freeing them: their records carry the nominal fraction beside
the measured bytes. kvpress's DuoAttention patterns are downloaded for a few large models only; here its streaming
heads are condcomp's DuoAttention gates (``results/kv/duo_gates.json``, ``condcomp calibrate-kv``), the lowest
two thirds of (layer, KV group) gates streaming 4 sink + 252 recent tokens, as ``split-duo-1of3``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

INSTALL = "pip install -e '.[kvpress]' && pip install --no-deps kvpress==0.5.5"
DUO_GATES = Path("results/kv/duo_gates.json")


def kvpress_kwargs(kwargs: dict[str, Any], q_len: int) -> dict[str, Any]:
    """The attention call's keyword arguments under the names kvpress 0.5.5's hook reads: ``past_key_values``
    (transformers 5.25: ``cache``) and ``cache_position`` (the first row of ``position_ids``, else 0..q_len-1)."""
    out = dict(kwargs)
    if "past_key_values" not in out and "cache" in out:
        out["past_key_values"] = out["cache"]
    if out.get("cache_position") is None:
        pos = out.get("position_ids")  # (B, T) or (1, T)
        out["cache_position"] = pos[0] if pos is not None else torch.arange(q_len)
    return out


@contextlib.contextmanager
def pressed(press: Any, model: nn.Module) -> Iterator[None]:
    """``with press(model)`` with the hook given transformers 5's arguments under kvpress's names."""
    original = press.forward_hook

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        return original(module, args, kvpress_kwargs(kwargs, kwargs["hidden_states"].shape[1]), output)

    press.forward_hook = hook  # the press registers its (instance) forward_hook on entering
    try:
        with press(model):
            yield
    finally:
        del press.forward_hook


def true_positions(cache: Any, new_tokens: int) -> Tensor | None:
    """``position_ids (1, new_tokens)`` continuing the request's true length when a press has evicted tokens from
    ``cache`` (its ``condcomp_seen`` attribute, set by :func:`mark_seen`), else None (transformers counts)."""
    seen = getattr(cache, "condcomp_seen", None)
    if seen is None:
        return None
    cache.condcomp_seen = seen + new_tokens
    return torch.arange(seen, seen + new_tokens).unsqueeze(0)


def mark_seen(cache: Any, tokens: int) -> Any:
    cache.condcomp_seen = tokens
    return cache


@dataclass(frozen=True)
class PressVariant:
    """``make(config)``: a fresh press; ``nominal``: the KV fraction the press aims at (None: measured bytes say
    it); ``headwise``: masks keys per head (nothing freed)."""

    make: Callable[[Any], Any]
    note: str
    nominal: float | None = None
    headwise: bool = False
    needs: Path | None = None
    min_tokens: int = 1  # SnapKV scores with the prompt's last 64 queries: it needs a longer prompt


def _eviction(cls_name: str, fraction: float) -> Callable[[Any], Any]:
    def make(config: Any) -> Any:
        import kvpress

        return getattr(kvpress, cls_name)(compression_ratio=1 - fraction)
    return make


def _adakv(fraction: float) -> Callable[[Any], Any]:
    def make(config: Any) -> Any:
        import kvpress

        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=1 - fraction))
    return make


def _duo(gates: Path, full_fraction: float, sinks: int = 4, window: int = 252) -> Callable[[Any], Any]:
    def make(config: Any) -> Any:
        import kvpress

        from condcomp.experiments.llm.duo_gates import load_gates, split_from_scores

        L, G = int(config.num_hidden_layers), int(config.num_key_value_heads)
        kept = split_from_scores(load_gates(gates, L, G)["scores"], full_fraction)
        streaming = torch.ones(L, G, dtype=torch.bool)  # (L, Hkv): True streams
        for layer, groups in enumerate(kept):
            streaming[layer, list(groups)] = False

        class GatesDuoPress(kvpress.DuoAttentionPress):  # type: ignore[misc, name-defined]
            def post_init_from_model(self, model: nn.Module) -> None:  # condcomp's gates, no download
                self.sink_size, self.recent_size = sinks, window
                self.streaming_mask = streaming.to(next(model.parameters()).device)

        return GatesDuoPress(head_compression_ratio=1 - full_fraction)
    return make


EVICTION = {"streaming": ("StreamingLLMPress", "StreamingLLM: the first and the most recent tokens"),
            "snapkv": ("SnapKVPress", "SnapKV: tokens the prompt's last queries attend most"),
            "expected": ("ExpectedAttentionPress", "ExpectedAttention: tokens future queries are expected to attend"),
            "knorm": ("KnormPress", "KNorm: tokens with the smallest key norms"),
            "tova": ("TOVAPress", "TOVA: tokens the last query attends most")}
PRESS_VARIANTS: dict[str, PressVariant] = {
    f"kvpress-{short}-{frac:.2f}": PressVariant(_eviction(cls, frac), f"kvpress {note}, keeps {frac:.2f} of the "
                                                f"prompt's tokens in every head", nominal=frac,
                                                min_tokens=65 if short == "snapkv" else 1)
    for frac in (0.5, 0.25) for short, (cls, note) in EVICTION.items()}
PRESS_VARIANTS["kvpress-adakv-snapkv-0.50"] = PressVariant(
    _adakv(0.5), "kvpress AdaKV over SnapKV at 0.5: a head-wise budget, evicted keys masked (nothing freed)",
    nominal=0.5, headwise=True, min_tokens=65)
PRESS_VARIANTS["kvpress-duo-gates-1of3"] = PressVariant(
    _duo(DUO_GATES, 1 / 3), "kvpress DuoAttentionPress with condcomp's DuoAttention gates (results/kv/"
    "duo_gates.json): a third of the KV groups full, the others 4 sink + 252 recent tokens, masked (nothing freed)",
    headwise=True, needs=DUO_GATES)


def missing(name: str) -> str | None:
    """Why press variant ``name`` cannot run here (a sentence), or None."""
    absent = [p for p in ("kvpress", "cachetools", "datasets", "fire", "requests")
              if importlib.util.find_spec(p) is None]
    if absent:
        return f"{name} needs kvpress (missing: {', '.join(absent)}): {INSTALL}"
    needs = PRESS_VARIANTS[name].needs
    if needs is not None and not needs.is_file():
        return f"{name} needs {needs} (condcomp calibrate-kv writes it)"
    return None


def nominal_fraction(name: str, model: nn.Module, kv_len: int) -> float | None:
    """The KV fraction a head-wise press would hold if its masked keys were freed (DuoAttention's: streaming heads
    keep sinks + window of ``kv_len`` tokens); None for other variants."""
    v = PRESS_VARIANTS.get(name)
    if v is None or not v.headwise:
        return None
    if v.nominal is not None:
        return v.nominal
    press = v.make(getattr(model, "config"))  # noqa: B009
    press.post_init_from_model(model)
    kept = min(1.0, (press.sink_size + press.recent_size) / kv_len)
    return 1 - float(press.streaming_mask.float().mean()) * (1 - kept)


def register(variants: dict[str, Any], models: dict[str, Any], variant_cls: type) -> None:
    """Add the press variants to ``bench kv``'s tables. An eviction press shares the dense model's prefill
    (:func:`captured`); a head-wise press masks keys in the model's later calls, so it prefills on its own."""
    for name, v in PRESS_VARIANTS.items():
        variants.setdefault(name, variant_cls(name if v.headwise else "dense", note=v.note))
        models.setdefault(name, lambda dense, ctx: dense)


def check_length(name: str, prompt_len: int) -> None:
    if prompt_len < (need := PRESS_VARIANTS[name].min_tokens):
        raise ValueError(f"{name} needs prompts of {need} tokens or more, got {prompt_len} (the decode timing's "
                         "--decode-prompt, or --prompts): give longer ones or leave it out of --time-decode")


@contextlib.contextmanager
def prefill_context(key: str, model: nn.Module, prompt_len: int,
                    group: list[str] | tuple[str, ...] = ()) -> Iterator[dict[str, dict[int, tuple[Tensor, Tensor]]]]:
    """During the prefill of model ``key``: the head-wise press of variant ``key`` applied to ``model``, or every
    eviction press of ``group`` capturing what it would keep (:func:`captured`); yields the captured layers."""
    if key in PRESS_VARIANTS:
        check_length(key, prompt_len)
        with pressed(PRESS_VARIANTS[key].make(getattr(model, "config")), model):  # noqa: B009
            yield {}
        return
    shared = [n for n in group if n in PRESS_VARIANTS and not PRESS_VARIANTS[n].headwise]
    for name in shared:
        check_length(name, prompt_len)
    with captured(shared, model) as held:
        yield held


@contextlib.contextmanager
def captured(names: list[str], model: nn.Module) -> Iterator[dict[str, dict[int, tuple[Tensor, Tensor]]]]:
    """One prefill serving every eviction press of ``names``: after each attention layer, each press compresses
    that layer's keys and values as its own hook would, into ``held[name][layer]``, and the cache is left whole.

    Equal to one prefill per press: a press compresses a layer's cache only after that layer's attention ran, and a
    prefill's attention reads the keys it has just computed, never the compressed cache, so every layer's hidden
    states (what the presses score with) are the dense prefill's (tests/bench/test_bench_kv_press.py compares)."""
    held: dict[str, dict[int, tuple[Tensor, Tensor]]] = {name: {} for name in names}
    with contextlib.ExitStack() as stack:
        for name in names:
            press = PRESS_VARIANTS[name].make(getattr(model, "config"))  # noqa: B009

            def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any, press: Any = press,
                     layers: dict[int, tuple[Tensor, Tensor]] = held[name]) -> Any:
                kw = kvpress_kwargs(kwargs, kwargs["hidden_states"].shape[1])
                i = int(getattr(module, "layer_idx"))  # noqa: B009  (nn.Module types attributes as Tensor | Module)
                layer = kw["past_key_values"].layers[i]
                layers[i] = press.compress(module, kw["hidden_states"], layer.keys, layer.values, output[1], kw)
                return output

            press.forward_hook = hook  # the press registers its (instance) forward_hook on entering
            stack.enter_context(press(model))
        yield held


def cache_from_captured(layers: dict[int, tuple[Tensor, Tensor]], config: Any, seen: int) -> Any:
    """A dynamic cache holding a press's compressed ``layers`` (keys, values ``(B, Hkv, T', Dh)``), having seen
    ``seen`` tokens (the positions later tokens continue from)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for idx, (keys, values) in sorted(layers.items()):
        cache.update(keys.clone(), values.clone(), idx)  # clones: continuing a request grows it, others reuse these
    return mark_seen(cache, seen)
