"""The variants of ``condcomp tune-llm``: how each one wraps the dense causal LM, and what it needs from condcomp.

Fractions are of SmolLM2's 9 query heads / 3 key/value (KV) groups. MoH variants route per token, so every
head's keys and values stay cached (KV fraction 1); the per-request and static variants drop whole KV groups
for a whole request.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

import condcomp


@dataclass(frozen=True)
class Variant:
    """One row of the study. ``config`` is a CondCompConfig as a dict (None: the dense model); ``static_keep``:
    KV groups per layer kept by static pruning (the head set comes from the importance scores)."""

    tuned: bool = True
    config: dict[str, Any] | None = None
    static_keep: int | None = None
    kv_fraction: float | None = 1.0  # None: measured (a learned budget)
    prompt_plans: bool = False  # needs condcomp.plan_from_prompt (sequence plans decided from the prompt)
    moh_fraction: float | None = None  # MoH conversion keeping this fraction of the heads per token
    warm_start: bool = False  # the router starts as static pruning (init_scores from the importance ranking)
    note: str = ""


def _request(fraction: float) -> dict[str, Any]:
    return {"policy": ["fixed", {"fraction": fraction}], "router": ["topk", {"kv_groups": True}]}


VARIANTS: dict[str, Variant] = {
    "dense_untuned": Variant(tuned=False, note="the model as shipped"),
    "dense_tuned": Variant(note="domain adaptation alone: same tuning, no routing"),
    "moh_75": Variant(moh_fraction=0.75,
                      note="MoH conversion: 4 shared + top-3 of 5 per token = 7/9 heads (ceil of 75 %)"),
    "moh_50": Variant(moh_fraction=0.5,
                      note="MoH conversion: 3 shared + top-2 of 6 per token = 5/9 heads (ceil of 50 %)"),
    "static_2of3": Variant(static_keep=2, kv_fraction=2 / 3,
                           note="static pruning: 2 of 3 KV groups per layer by gradient importance"),
    "static_1of3": Variant(static_keep=1, kv_fraction=1 / 3,
                           note="static pruning: 1 of 3 KV groups per layer by gradient importance"),
    "request_2of3": Variant(config=_request(2 / 3), kv_fraction=2 / 3, prompt_plans=True,
                            note="per-request plan from the prompt: learned scorer, 2 of 3 KV groups"),
    "request_1of3": Variant(config=_request(1 / 3), kv_fraction=1 / 3, prompt_plans=True,
                            note="per-request plan from the prompt: learned scorer, 1 of 3 KV groups"),
    "request_2of3_warm": Variant(config=_request(2 / 3), kv_fraction=2 / 3, prompt_plans=True, warm_start=True,
                                 note="per-request plan, learned scorer started from the static ranking, 2 of 3"),
    "request_1of3_warm": Variant(config=_request(1 / 3), kv_fraction=1 / 3, prompt_plans=True, warm_start=True,
                                 note="per-request plan, learned scorer started from the static ranking, 1 of 3"),
    "budgetformer": Variant(config={"policy": ["budgetformer", {"s_min": 1 / 3, "s_max": 2 / 3}],
                                    "router": ["topk", {"kv_groups": True}]},
                            kv_fraction=None, prompt_plans=True,
                            note="BudgetFormer's learned per-request budget, hinge interval [1/3, 2/3], KV groups"),
}
DEFAULT_ORDER = tuple(VARIANTS)


def moh_config(fraction: float, num_heads: int) -> dict[str, Any]:
    """MoH's conversion at ``fraction`` of ``num_heads``: ``ceil(fraction * H)`` heads per token, half of them
    (rounded up) shared, close to MoH-LLaMA3 (16 shared + top-8 of 32). Here, 9 heads: 75 % -> 4 shared +
    top-3 of 5; 50 % -> 3 shared + top-2 of 6). Parameter-free query-norm router, binary straight-through gates.

    >>> moh_config(0.75, 9)["router"]
    ['norm', {'shared_heads': 4, 'top_k': 3}]
    """
    kept = max(1, math.ceil(fraction * num_heads - 1e-9))
    shared = math.ceil(kept / 2)
    return {"policy": "full", "router": ["norm", {"shared_heads": shared, "top_k": kept - shared}]}


def parse_decode_variant(name: str) -> tuple[str, float]:
    """``(kind, fraction)`` of a ``condcomp bench decode`` variant name: ``dense`` / ``full`` (fraction 1),
    ``keep_<f>``, ``stream_<f>``, ``moh_<f>``, ``floor_<f>``."""
    if name in ("dense", "full"):
        return name, 1.0
    kind, _, value = name.partition("_")
    f = float(value) if re.fullmatch(r"\d*\.?\d+", value) else -1.0
    if kind not in ("keep", "stream", "moh", "floor") or not 0.0 < f <= 1.0:
        raise ValueError(f"unknown decode variant {name!r}: use dense, full, keep_<f>, stream_<f>, moh_<f> or "
                         "floor_<f> with f in (0, 1], e.g. keep_0.33, stream_0.33, moh_0.75 or floor_0.33")
    return kind, f


def num_heads(model: nn.Module) -> int:
    """Query heads per layer of a transformers model (its ``config.num_attention_heads``)."""
    return int(getattr(model, "config").num_attention_heads)  # noqa: B009  (nn.Module's typing hides config)


def variant_config(name: str, num_heads: int) -> dict[str, Any] | None:
    """The CondCompConfig (as a dict) of a routed variant; None for dense and static ones."""
    v = VARIANTS[name]
    return moh_config(v.moh_fraction, num_heads) if v.moh_fraction is not None else v.config


class MissingFeature(RuntimeError):
    """The variant needs a condcomp feature this installation lacks (recorded as skipped, not failed)."""


def check_supported(name: str) -> None:
    """Raise :class:`MissingFeature` when the variant cannot run here (before any tuning time is spent)."""
    v = VARIANTS[name]
    if v.prompt_plans and not hasattr(condcomp, "plan_from_prompt"):
        raise MissingFeature(f"{name} needs condcomp.plan_from_prompt (per-request plans decided from the prompt)")
    if v.config is not None:
        try:
            condcomp.CondCompConfig.from_dict(dict(v.config))
        except (TypeError, ValueError) as err:
            raise MissingFeature(f"{name}: this condcomp cannot build its config ({err})") from None


def apply_variant(model: nn.Module, name: str, executor: str = "auto",
                  static_heads: list[list[int]] | None = None, warm_scores: list[list[float]] | None = None) -> None:
    """Wrap ``model`` in place as variant ``name`` (dense variants: nothing to do).

    ``static_heads[l]`` is layer l's kept query heads (static variants); ``warm_scores[l]`` layer l's router
    ``init_scores`` (warm-started variants). Both wrap one layer per ``apply_`` call.
    """
    v = VARIANTS[name]
    check_supported(name)
    if v.static_keep is not None:
        if static_heads is None:
            raise ValueError(f"{name} needs the static head sets (static_heads)")
        configs: list[dict[str, Any]] = [{"policy": "full", "router": ("static", {"heads": heads})}
                                         for heads in static_heads]
        return _apply_per_layer(model, configs, executor)
    config = variant_config(name, num_heads(model))
    if v.warm_start:
        if warm_scores is None or config is None:
            raise ValueError(f"{name} needs the router's initial scores per layer (warm_scores)")
        router, options = config["router"]
        configs = [{**config, "router": (router, {**options, "init_scores": scores})} for scores in warm_scores]
        return _apply_per_layer(model, configs, executor)
    if config is not None:
        condcomp.apply_(model, condcomp.CondCompConfig.from_dict({**config, "executor": executor}))


def _apply_per_layer(model: nn.Module, configs: list[dict[str, Any]], executor: str) -> None:
    """``configs[l]`` (a CondCompConfig as a dict) wraps the l-th ``*self_attn`` module."""
    layers = [n for n, _ in model.named_modules() if n.endswith("self_attn")]
    if len(layers) != len(configs):
        raise ValueError(f"{len(configs)} per-layer settings for {len(layers)} attention layers")
    for layer, config in zip(layers, configs):
        condcomp.apply_(model, condcomp.CondCompConfig.from_dict({**config, "executor": executor,
                                                                  "target_modules": [layer]}))
