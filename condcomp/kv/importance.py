"""Static head pruning for causal LMs: Michel et al.'s gradient-based head importance, aggregated per key/value group.

Michel, Levy & Neubig (2019, "Are Sixteen Heads Really Better than One?") score head h by
``I_h = E_x |dL(x)/d xi_h|``, where ``xi_h`` is a gate multiplying the head's output (evaluated at ``xi = 1``):
the first-order estimate of the loss change when the head is masked, made absolute per example. A grouped-query
model can only save cache memory by dropping whole key/value groups, so the unit scored here is the group: a gate
``xi_g`` multiplying every query head of group g, whose derivative is the sum of its heads' derivatives, made
absolute per example, then averaged. The gates are applied at the input of each layer's output projection
(``self_attn.o_proj`` in Llama-style models, whose input is the heads' outputs side by side, head-major).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

LossFn = Callable[[nn.Module, Tensor], Tensor]  # (model, ids (B, T)) -> per-example loss (B,)


def output_projections(model: nn.Module) -> list[nn.Module]:
    """Each layer's attention output projection, in layer order (``...layers.<i>.self_attn.o_proj``)."""
    found = [(name, m) for name, m in model.named_modules() if name.endswith("self_attn.o_proj")]
    if not found:
        raise ValueError("no '*.self_attn.o_proj' module found: head importance supports Llama-style causal LMs")
    return [m for _, m in found]


def head_gradients(model: nn.Module, batches: list[Tensor], loss_fn: LossFn, num_heads: int) -> Tensor:
    """``dL_b / d xi_{l,h}`` at ``xi = 1`` for every example b: a ``(N, L, H)`` tensor (N = examples of all batches).

    The model's parameters get no gradient (only the gates require one).
    """
    projs = output_projections(model)
    grads: list[Tensor] = []
    gates: dict[int, Tensor] = {}

    def hook(layer: int) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Tensor]]:
        def pre(_: nn.Module, args: tuple[Any, ...]) -> tuple[Tensor]:
            x = args[0]  # (B, T, H * Dh)
            B, T, width = x.shape
            g = gates[layer].to(x.dtype)  # (B, H)
            return ((x.view(B, T, num_heads, width // num_heads) * g[:, None, :, None]).view(B, T, width),)
        return pre

    handles = [p.register_forward_pre_hook(hook(i)) for i, p in enumerate(projs)]
    requires = {n: p.requires_grad for n, p in model.named_parameters()}
    dtype = next(model.parameters()).dtype  # gates in the model's dtype: a float64 check stays float64
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for ids in batches:
            for i in range(len(projs)):
                gates[i] = torch.ones(ids.shape[0], num_heads, dtype=dtype, requires_grad=True)
            per_example = loss_fn(model, ids)  # (B,)
            per_example.sum().backward()  # example b's loss depends only on its own gates
            grads.append(torch.stack([gates[i].grad for i in range(len(projs))], dim=1))  # type: ignore[misc]
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(requires[n])
    return torch.cat(grads).double()  # (N, L, H)


def group_importance(grads: Tensor, num_kv_heads: int) -> Tensor:
    """``(L, Hkv)``: ``mean_b |sum_{h in g} dL_b/d xi_h|`` (query heads ``g * H/Hkv ... (g+1) * H/Hkv - 1``)."""
    N, L, H = grads.shape
    if H % num_kv_heads:
        raise ValueError(f"{H} query heads do not split into {num_kv_heads} key/value groups")
    return grads.view(N, L, num_kv_heads, H // num_kv_heads).sum(-1).abs().mean(0)


def head_importance(grads: Tensor) -> Tensor:
    """``(L, H)``: Michel et al.'s per-head score ``mean_b |dL_b/d xi_h|`` (reported beside the group scores)."""
    return grads.abs().mean(0)


def keep_groups(scores: Tensor, keep: int) -> list[list[int]]:
    """Per layer, the ``keep`` most important groups, most important first (ties: the lower index)."""
    L, G = scores.shape
    if not 1 <= keep <= G:
        raise ValueError(f"keep must be in [1, {G}], got {keep}")
    order = sorted(range(G), key=lambda g: g)
    return [sorted(order, key=lambda g: -float(scores[layer, g]))[:keep] for layer in range(L)]


def group_heads(groups: list[int], num_heads: int, num_kv_heads: int) -> list[int]:
    """The query heads of ``groups`` (in the groups' order)."""
    rep = num_heads // num_kv_heads
    return [g * rep + j for g in groups for j in range(rep)]


def warm_start_scores(scores: Tensor, spacing: float = 2.0) -> list[list[float]]:
    """Per layer, ``init_scores`` for the ``topk`` router that rank the groups as ``keep_groups`` does:
    ``spacing * (G - 1 - rank)`` (most important group highest, ties to the lower index). Scores ``spacing``
    apart outlast the router's early training noise (std 0.5 at the start), so the tuned router begins as static
    pruning and moves away from it only where the gradient says so.

    >>> warm_start_scores(torch.tensor([[0.1, 0.5, 0.3]]))
    [[0.0, 4.0, 2.0]]
    """
    L, G = scores.shape
    ranking = keep_groups(scores, G)  # (L, G) groups, most important first
    return [[spacing * (G - 1 - ranking[layer].index(g)) for g in range(G)] for layer in range(L)]


def continuation_importance(model: nn.Module, calibration: Tensor, prompt_len: int, batch_size: int = 4) -> Tensor:
    """Group importance ``(L, G)`` of a transformers decoder on ``calibration (N, T)`` token rows: the gradient of
    each row's mean loss on its tokens after ``prompt_len`` (:func:`condcomp.kv.continuation.continuation_nll`),
    in batches of ``batch_size``, as ``condcomp tune-llm`` ranks groups for static pruning."""
    from condcomp.kv.continuation import continuation_nll

    cfg: Any = getattr(model, "config")  # noqa: B009
    grads = head_gradients(model, list(calibration.split(batch_size)),
                           lambda m, ids: continuation_nll(m, ids, prompt_len).mean(-1), int(cfg.num_attention_heads))
    return group_importance(grads, int(cfg.num_key_value_heads))


def saved_importance(path: Path, layers: int, groups: int) -> Tensor | None:
    """``group_importance`` from a ``static_importance.json`` (``condcomp tune-llm``'s), if it fits the model."""
    from condcomp.files import field, float_matrix, read_json_object

    if not path.is_file():
        return None
    hint = "write it with `condcomp tune-llm` (static_importance.json) or leave it out to compute the importance"
    record = read_json_object(path, "static pruning's group importance", hint)
    scores = float_matrix(field(record, "group_importance", path, hint), path, "group_importance", hint)
    # another model's ranking (the default path holds SmolLM2's): the callers compute this model's instead
    return scores if tuple(scores.shape) == (layers, groups) else None
