"""DuoAttention's gated attention for calibration: every KV group mixes full and streaming attention by a gate.

Xiao et al. (ICLR 2025, "DuoAttention") give each head a gate ``alpha`` in [0, 1]; during calibration the head's
output is ``alpha * full_attention + (1 - alpha) * streaming_attention``, where streaming attention sees only the
first ``sinks`` tokens and the last ``window`` tokens (:func:`condcomp.masks.streaming_allowed`). A grouped-query
model saves cache memory only per key/value group, so here the gate is one per (layer, KV group), shared by the
group's query heads. The model's weights stay frozen; only the gates train (:mod:`condcomp.kv.duo_gates`).

The gated forward runs through transformers' ``AttentionInterface``: :func:`gated` registers the attention
function ``"condcomp_duo"``, points the model's config at it and hands each attention module its layer's gates;
on exit the model is as it was. Calibration only: cache-free forwards of causal self-attention (a call on a KV
cache is refused), each query attending its request's real tokens (left padding counts positions from the first
real token, as condcomp's streaming cache does).

>>> gates = DuoGates(layers=30, groups=3, sinks=4, window=252)
>>> with gated(model, gates):  # doctest: +SKIP
...     hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from condcomp.kv.window import query_positions
from condcomp.masks import streaming_allowed

ATTN_NAME = "condcomp_duo"
REF_ATTR = "condcomp_duo_gate"  # set on each attention module while gated: its (gates, layer) reference


class DuoGates(nn.Module):
    """``alpha (L, G)``: one gate per (layer, KV group), 1 = the group's heads attend the full context, 0 = they
    attend the streaming window (``sinks`` first + ``window`` last tokens). Starts at ``init`` (DuoAttention: 1)."""

    def __init__(self, layers: int, groups: int, sinks: int = 4, window: int = 252, init: float = 1.0) -> None:
        super().__init__()
        if layers < 1 or groups < 1:
            raise ValueError(f"DuoGates needs at least one layer and one KV group, got {layers} x {groups}")
        if sinks < 0 or window < 1:
            raise ValueError(f"DuoGates: sinks must be >= 0 and window >= 1, got sinks={sinks}, window={window}")
        if not 0.0 <= init <= 1.0:
            raise ValueError(f"DuoGates: init must be in [0, 1], got {init}")
        self.sinks, self.window = int(sinks), int(window)
        self.alpha = nn.Parameter(torch.full((layers, groups), float(init)))

    @property
    def layers(self) -> int:
        return int(self.alpha.shape[0])

    def layer_alpha(self, layer: int) -> Tensor:
        """``(G,)``: the layer's gates, shared by every row."""
        return self.alpha[layer]

    def clamp_(self) -> None:
        """Project the gates back into [0, 1] (after each optimizer step, as DuoAttention does)."""
        with torch.no_grad():
            self.alpha.clamp_(0.0, 1.0)


class RowGates:
    """Per-row gates: for each layer, ``(B, G)`` (one per KV group) or ``(B, H)`` (one per query head, equal within
    a group) set by whoever decides them before the layer's attention runs (a forward pre-hook, e.g. a per-request
    router's plan: :mod:`condcomp.kv.request_router`). Rows of one batch may then mix differently."""

    def __init__(self, layers: int, sinks: int = 4, window: int = 252) -> None:
        if layers < 1:
            raise ValueError(f"RowGates needs at least one layer, got {layers}")
        if sinks < 0 or window < 1:
            raise ValueError(f"RowGates: sinks must be >= 0 and window >= 1, got sinks={sinks}, window={window}")
        self.layers, self.sinks, self.window = int(layers), int(sinks), int(window)
        self.rows: list[Tensor | None] = [None] * self.layers

    def layer_alpha(self, layer: int) -> Tensor:
        gates = self.rows[layer]
        if gates is None:
            raise RuntimeError(f"no per-row gates were set for layer {layer} before its attention ran: set "
                               "RowGates.rows[layer] (B, G) in a forward pre-hook of the layer's attention")
        return gates


GateSource = DuoGates | RowGates


class _LayerGate:
    """What one attention module reads while gated. A plain object: the gates stay out of the module's parameters
    and ``state_dict``."""

    def __init__(self, gates: GateSource, layer: int) -> None:
        self.gates, self.layer = gates, layer


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules in layer order (``...self_attn``, Llama-style)."""
    found = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not found:
        raise ValueError("no '*.self_attn' module found: DuoAttention gates support Llama-style causal LMs")
    return found


def real_positions(attention_mask: Any, B: int, T: int, device: torch.device) -> Tensor:
    """``(B, T)`` each token's position among its request's real tokens, ``-1`` for padding, from the mask
    transformers hands an attention function (None: no padding; 4-D: a key is real when some query may see it)."""
    if attention_mask is None:
        return query_positions(None, None, B, T, device)
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() not in (2, 4):
        raise ValueError("DuoAttention gates need a tensor attention mask (2-D or 4-D); load the model with "
                         "attn_implementation='sdpa' or 'eager'")
    if attention_mask.dim() == 2:
        real = attention_mask.bool()
    else:
        allowed = attention_mask if attention_mask.dtype == torch.bool else (
            attention_mask > torch.finfo(attention_mask.dtype).min / 2)
        real = allowed.any(dim=1).any(dim=1).expand(B, T)  # (B|1, 1, T, S) -> (B, S), S = T
    return query_positions(None, real.expand(B, T), B, T, device)


def duo_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """The function registered as ``"condcomp_duo"``: ``(B, T, H, Dh)`` outputs mixing full and streaming
    attention per KV group by the module's gates (modules without gates run plain SDPA). The gates are ``(G,)``
    for every row (:class:`DuoGates`) or per row ``(B, G)`` / ``(B, H)`` (:class:`RowGates`)."""
    ref = module.__dict__.get(REF_ATTR)
    if not isinstance(ref, _LayerGate):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # type: ignore[no-any-return]
    B, H, T, _ = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    if S != T:
        raise RuntimeError(f"DuoAttention gates calibrate cache-free forwards ({T} queries, {S} keys): call the "
                           "model with use_cache=False and no past key values")
    a = head_gates(ref.gates.layer_alpha(ref.layer), ref.layer, B, H, Hkv).to(query.dtype)  # (B|1, H, 1, 1)
    pos = real_positions(attention_mask, B, T, query.device)  # (B, T)
    q, k = pos.unsqueeze(-1), pos.unsqueeze(-2)  # (B, T, 1), (B, 1, T)
    full = (q >= 0) & (k >= 0) & (k <= q)  # (B, T, T): causal over real tokens
    stream = streaming_allowed(pos, pos, ref.gates.sinks, ref.gates.window)  # (B, T, T)
    dead = ~full.any(-1, keepdim=True)  # (B, T, 1): padding queries; opened so softmax stays finite, zeroed below
    r = H // Hkv
    kr, vr = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)  # (B, H, T, Dh)
    drop = dropout if module.training else 0.0
    o_full = F.scaled_dot_product_attention(query, kr, vr, attn_mask=(full | dead).unsqueeze(1), dropout_p=drop,
                                            scale=scaling)  # (B, H, T, Dh)
    o_stream = F.scaled_dot_product_attention(query, kr, vr, attn_mask=(stream | dead).unsqueeze(1), dropout_p=drop,
                                              scale=scaling)
    out = (o_stream + a * (o_full - o_stream)).masked_fill(dead.unsqueeze(1), 0.0)
    return out.transpose(1, 2).contiguous(), None


def head_gates(alpha: Tensor, layer: int, B: int, H: int, Hkv: int) -> Tensor:
    """``(1 | B, H, 1, 1)`` per query head from gates ``(G,)``, ``(B, G)`` or ``(B, H)``: a group's heads share it."""
    if H % Hkv:
        raise ValueError(f"layer {layer} has {H} query heads, not a multiple of its {Hkv} key/value heads")
    rows = alpha if alpha.dim() == 2 else alpha.unsqueeze(0)  # (B|1, G|H)
    if alpha.dim() not in (1, 2) or rows.shape[-1] not in (Hkv, H) or (alpha.dim() == 2 and rows.shape[0] != B):
        raise ValueError(f"the gates of layer {layer} have shape {tuple(alpha.shape)}; the layer needs ({Hkv},), "
                         f"({B}, {Hkv}) or ({B}, {H}) for {B} rows, {Hkv} key/value heads and {H} query heads")
    if rows.shape[-1] == Hkv:
        rows = rows.repeat_interleave(H // Hkv, dim=-1)
    return rows[:, :, None, None]


def register() -> None:
    """Register ``"condcomp_duo"`` in transformers' ``AttentionInterface`` (and its mask function, SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, duo_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


@contextmanager
def gated(model: nn.Module, gates: GateSource) -> Iterator[nn.Module]:
    """Within the block, ``model`` computes DuoAttention's gated attention with ``gates``; restored on exit."""
    modules = attention_modules(model)
    if len(modules) != gates.layers:
        raise ValueError(f"the gates hold {gates.layers} layers, the model has {len(modules)} attention layers")
    register()
    configs: list[Any] = [getattr(m, "config") for m in model.modules()  # noqa: B009
                          if hasattr(getattr(m, "config", None), "_attn_implementation")]
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = ATTN_NAME
        for layer, m in enumerate(modules):
            m.__dict__[REF_ATTR] = _LayerGate(gates, layer)
        yield model
    finally:
        for c, impl in zip(configs, before):
            c._attn_implementation = impl
        for m in modules:
            m.__dict__.pop(REF_ATTR, None)
