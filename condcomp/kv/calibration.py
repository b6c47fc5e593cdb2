"""Splits of a decoder's KV groups into full and windowed ones, from calibration: the public entry points.

Three ways to decide which (layer, KV group) pairs keep their full cache, the others getting the ``window`` KV
policy (first ``sinks`` + last ``window`` tokens):

- :func:`duo_split`: DuoAttention gates from a gates file (``condcomp calibrate-kv --method duo``; the repository
  commits ``results/kv/duo_gates.json`` for SmolLM2-135M): the highest-scored fraction of all pairs stays full,
  globally over layers, and every request gets the same split.
- :func:`static_split`: static pruning's gradient importance per group (:func:`group_importance` of
  :func:`head_gradients`), the same kept count in every layer.
- :func:`request_split`: a per-request router file (``condcomp calibrate-kv --method request``): each prompt picks
  its own full groups (:func:`load_request_split` reads the file).

Each applies condcomp to the model in place (one ``topk`` router per attention layer, ``kv=("window", ...)``) and
returns it. What makes their inputs is public here too: DuoAttention gate training (:func:`train_gates` with
:class:`DuoSettings`, :class:`DuoGates`, :func:`gated`, :func:`save_gates`; :mod:`condcomp.kv.duo_gates`), gradient
importance (:func:`continuation_importance`; :mod:`condcomp.kv.importance`) and the per-request router
(:func:`train_router`, :func:`save_router`; :mod:`condcomp.kv.request_router`). ``condcomp calibrate-kv`` runs them
on SmolLM2 with its calibration text; these names are the stable ones to call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from condcomp.api import apply_, routed_modules, routing_hosts
from condcomp.config import CondCompConfig
from condcomp.kv.continuation import continuation_nll
from condcomp.kv.duo_attention import DuoGates, gated
from condcomp.kv.duo_gates import DuoSettings, load_gates, save_gates, split_from_scores, train_gates
from condcomp.kv.importance import (
    continuation_importance,
    group_heads,
    group_importance,
    head_gradients,
    head_importance,
    keep_groups,
    warm_start_scores,
)
from condcomp.kv.request_router import RequestSettings, RequestSplit, save_router, train_router
from condcomp.kv.request_router import load_router as _load_router

__all__ = ["DuoGates", "DuoSettings", "RequestSettings", "RequestSplit", "continuation_importance",
           "continuation_nll", "duo_split", "gated", "group_heads", "group_importance", "head_gradients",
           "head_importance", "keep_groups", "load_gates", "load_request_split", "request_split", "save_gates",
           "save_router", "split_from_scores", "static_split", "train_gates", "train_router", "warm_start_scores"]


def attention_layers(model: nn.Module) -> list[str]:
    """The names of a Llama-family decoder's attention modules (``*self_attn``), in order."""
    layers = [name for name, _ in model.named_modules() if name.endswith("self_attn")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no modules named '*self_attn' (a Llama-family decoder's "
                         "attention layers): the KV splits are for those decoders")
    return layers


def head_groups(model: nn.Module) -> tuple[int, int]:
    """``(query heads, key/value groups)`` of a transformers decoder's config."""
    cfg: Any = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_key_value_heads"):
        raise ValueError(f"{type(model).__name__} has no config.num_key_value_heads: the KV splits are for "
                         "transformers decoders with key/value groups (Llama, Qwen2/3, Mistral, Gemma)")
    return int(cfg.num_attention_heads), int(cfg.num_key_value_heads)


def _apply_layers(model: nn.Module, kept_counts: list[int], scores: list[list[float]] | None, G: int,
                  sinks: int, window: int) -> None:
    inits: list[list[float] | None] = list(scores) if scores is not None else [None] * len(kept_counts)
    layers = attention_layers(model)
    wrapped = [name for name in layers if name in routed_modules(model)]
    if wrapped:  # refused before any layer is wrapped (it failed at the first wrapped one, the earlier ones split)
        more = " ..." if len(wrapped) > 3 else ""
        raise ValueError(f"the KV split wraps every attention layer, and {wrapped[:3]}{more} are already wrapped: "
                         "call condcomp.remove_(model) first")
    for layer, keep, init in zip(layers, kept_counts, inits, strict=True):
        router = ("topk", {"kv_groups": True} if init is None else {"kv_groups": True, "init_scores": init})
        apply_(model, CondCompConfig(policy=("fixed", {"fraction": keep / G, "k_min": 0}), router=router,
                                     kv=("window", {"sinks": sinks, "window": window}), target_modules=[layer]))


def duo_split(model: nn.Module, path: str | Path, fraction: float, *, window: int | None = None,
              sinks: int | None = None) -> nn.Module:
    """Apply a DuoAttention split from a gates file in place: the ``fraction`` of all (layer, KV group) pairs with
    the highest gates keeps the full cache (a layer may keep none or all of its groups), the others stream the
    file's ``sinks`` + ``window`` tokens (or the ones given). Returns ``model``, in eval mode.

    >>> import condcomp.kv.calibration as kvc  # doctest: +SKIP
    >>> model = kvc.duo_split(smollm2, "results/kv/duo_gates.json", 1 / 3)  # doctest: +SKIP
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"duo_split: fraction must be in [0, 1] (the share of (layer, group) pairs kept in full), "
                         f"got {fraction}")
    _, G = head_groups(model)
    record = load_gates(path, len(attention_layers(model)), G)
    kept = split_from_scores(record["scores"], fraction)
    _apply_layers(model, [len(k) for k in kept], warm_start_scores(record["scores"]), G,
                  int(record["sinks"] if sinks is None else sinks), int(record["window"] if window is None else window))
    return model.eval()


def static_split(model: nn.Module, importance: Tensor, fraction: float, *, window: int = 252,
                 sinks: int = 4) -> nn.Module:
    """Apply static pruning's split in place: in every layer the ``fraction`` of KV groups that ``importance
    (L, G)`` ranks highest keeps the full cache (at least one), the others stream ``sinks`` + ``window`` tokens
    (``fraction`` 0: every group streams, StreamingLLM). Returns ``model``, in eval mode."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"static_split: fraction must be in [0, 1], got {fraction}")
    _, G = head_groups(model)
    layers = attention_layers(model)
    if tuple(importance.shape) != (len(layers), G):
        raise ValueError(f"static_split: importance has shape {tuple(importance.shape)}, this model needs "
                         f"({len(layers)}, {G}) (one score per layer and KV group)")
    if not bool(importance.isfinite().all()):  # NaN ranked as the most important group
        raise ValueError(f"static_split: importance holds non-finite scores at (layer, group) "
                         f"{(~importance.isfinite()).nonzero().tolist()}: compute it again (group_importance)")
    keep = 0 if fraction == 0 else max(1, round(fraction * G))
    _apply_layers(model, [keep] * len(layers), warm_start_scores(importance), G, sinks, window)
    return model.eval()


def load_request_split(path: str | Path, model: nn.Module) -> RequestSplit:
    """The per-request routers of a router file (``condcomp calibrate-kv --method request``), checked against
    ``model``'s shape; a string path works too."""
    return _load_router(Path(path), model)


def request_split(model: nn.Module, path: str | Path) -> nn.Module:
    """Apply a per-request split in place: per layer a ``topk`` router with the file's scorer picks from each
    prompt the file's ``keep`` KV groups kept in full; the others stream the file's sinks + window. Returns
    ``model``, in eval mode."""
    split = load_request_split(path, model)
    _apply_layers(model, [split.keep] * len(attention_layers(model)), None, split.groups, split.sinks, split.window)
    for host, trained in zip(routing_hosts(model).values(), split.routers, strict=True):  # in layer order
        host.condcomp_router.scorer.load_state_dict(trained.scorer.state_dict())  # type: ignore[union-attr]
    return model.eval()
