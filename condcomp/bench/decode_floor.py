"""The decode floor of ``keep_<f>``: a dense model built with only the kept key/value groups.

``keep_<f>`` keeps the fraction f of a layer's key/value groups per request and skips the query heads that read the
others, so a decode step reads f of the cache and runs f of the attention projections. The fastest it could be is
a plain dense model that never had the other groups: ``floor_<f>`` is that model (every layer's first
:func:`kept_groups` groups, as many as ``keep_<f>`` keeps, and their query heads, the rest of the weights shared
with dense), decoding on
transformers' own cache. It is a different model (its greedy tokens differ from dense's); it times, as the k-head
floor does for the gathered executor, what the compact cache costs above the work it keeps.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from condcomp.plans import budget_k_bound


def kept_groups(num_kv_heads: int, fraction: float, num_heads: int | None = None) -> int:
    """The key/value groups ``keep_<fraction>`` keeps per layer: its budget rule, ``k = clamp(floor(fraction * H), 1,
    H)`` query heads (:func:`condcomp.budget_k`), in whole groups of ``H / num_kv_heads`` heads (the ``topk``
    router's ``kv_groups``: ``ceil(k / heads per group)``). ``num_heads``: the layer's query heads ``H`` (default
    ``num_kv_heads``: one query head per group).

    >>> kept_groups(8, 0.33), kept_groups(3, 0.5, num_heads=9)
    (2, 2)
    """
    heads = num_kv_heads if num_heads is None else int(num_heads)
    if num_kv_heads < 1 or heads % num_kv_heads:
        raise ValueError(f"{heads} query heads do not split into {num_kv_heads} key/value groups")
    per_group = heads // num_kv_heads
    return max(1, min(num_kv_heads, -(-budget_k_bound(fraction, heads) // per_group)))


def floor_model(dense: nn.Module, fraction: float) -> nn.Module:
    """A copy of the transformers Llama-family ``dense`` with only the first :func:`kept_groups` key/value groups
    (and the query heads reading them) in every layer; its config says so, so a cache built from it holds only those
    groups. Raises ValueError for a model whose attention has no ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``."""
    if not hasattr(dense, "config"):
        raise ValueError(f"floor_{fraction:g}: {type(dense).__name__} has no transformers config; the floor variant "
                         "cuts a transformers Llama-family model")
    config: Any = copy.deepcopy(getattr(dense, "config"))  # noqa: B009
    heads, groups = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    kept = kept_groups(groups, fraction, heads)
    per_group = heads // groups
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = kept * per_group, kept, head_dim
    floor = copy.deepcopy(dense)
    floor.config = config
    attentions = [m for m in floor.modules() if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    if not attentions:
        raise ValueError(f"floor_{fraction:g}: {type(dense).__name__} has no q/k/v/o-projection attention to cut; "
                         "the floor variant supports Llama-family models")
    q_rows, kv_rows = kept * per_group * head_dim, kept * head_dim  # heads are consecutive blocks of head_dim rows
    for attention in attentions:
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            setattr(attention, name, _rows(getattr(attention, name), rows))
        attention.o_proj = _columns(getattr(attention, "o_proj"), q_rows)  # noqa: B009
        attention.config = config
    return floor


def _rows(linear: nn.Linear, rows: int) -> nn.Linear:
    """``linear`` keeping its first ``rows`` outputs."""
    cut = nn.Linear(linear.in_features, rows, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    cut.weight.data.copy_(linear.weight.data[:rows])
    if linear.bias is not None:
        cut.bias.data.copy_(linear.bias.data[:rows])
    return cut


def _columns(linear: nn.Linear, columns: int) -> nn.Linear:
    """``linear`` reading only its first ``columns`` inputs."""
    cut = nn.Linear(columns, linear.out_features, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    cut.weight.data.copy_(linear.weight.data[:, :columns])
    if linear.bias is not None:
        cut.bias.data.copy_(linear.bias.data)
    return cut


__all__ = ["floor_model", "kept_groups"]
