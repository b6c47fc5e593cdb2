"""The decode floor of ``keep_<f>``: a dense model built with only the kept key/value groups.

``keep_<f>`` keeps the fraction f of a layer's key/value groups per request and skips the query heads that read the
others, so a decode step reads f of the cache and runs f of the attention projections. The fastest it could be is
a plain dense model that never had the other groups: ``floor_<f>`` is that model (every layer's first
``round(f * groups)`` groups and their query heads, the rest of the weights shared with dense), decoding on
transformers' own cache. It is a different model (its greedy tokens differ from dense's); it times, as the k-head
floor does for the gathered executor, what the compact cache costs above the work it keeps.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn


def kept_groups(num_kv_heads: int, fraction: float) -> int:
    """The key/value groups ``keep_<fraction>`` keeps per layer (at least one)."""
    return max(1, min(num_kv_heads, round(fraction * num_kv_heads)))


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
    kept = kept_groups(groups, fraction)
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
