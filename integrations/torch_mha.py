"""``torch.nn.MultiheadAttention`` (alone or inside ``nn.TransformerEncoderLayer``/``DecoderLayer``)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from condcomp.adapters import AttentionAdapter, register_adapter
from condcomp.masks import additive_bias, causal_bias, check_mask_dtype
from condcomp.projections import linear_parts, tensor_problem
from condcomp.types import AttentionWeights, HeadLayout

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """nn.MultiheadAttention's masks: bool True = *not* allowed, or already additive floats."""
    return additive_bias(~mask, dtype) if mask.dtype == torch.bool else mask.to(dtype)


@register_adapter
class TorchMultiheadAttentionAdapter(AttentionAdapter):
    """Every layout ``nn.MultiheadAttention`` accepts: batch_first or not, unbatched ``(T, D)`` input, fused or
    separate q/k/v weights (``kdim``/``vdim``), self- and cross-attention, bool or float ``key_padding_mask`` and
    ``attn_mask`` (``(T, S)`` or ``(B*H, T, S)``), ``is_causal``. Attention weights are never materialised:
    ``need_weights=True`` returns None in their place (with a one-time warning).
    """

    module_types = (nn.MultiheadAttention,)

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        assert isinstance(module, nn.MultiheadAttention)
        if module.bias_k is not None or module.bias_v is not None:
            return "add_bias_kv=True appends learned key/value rows shared by all heads; condcomp does not route them"
        if module.add_zero_attn:
            return "add_zero_attn=True appends a zero key/value row; condcomp does not support it"
        names = ("in_proj_weight", "in_proj_bias") if module._qkv_same_embed_dim else (
            "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")
        for name in names:
            problem = tensor_problem(getattr(module, name), name)
            if problem is not None:
                return problem
        return None

    def __init__(self, module: nn.Module) -> None:
        assert isinstance(module, nn.MultiheadAttention)
        D, H = module.embed_dim, module.num_heads
        Dh = D // H
        self.layout = HeadLayout(
            d_model=D, num_heads=H, num_kv_heads=H, head_dim=Dh, scale=Dh**-0.5, dropout_p=module.dropout,
            kdim=None if module.kdim == D else module.kdim, vdim=None if module.vdim == D else module.vdim,
        )
        self.batch_first = module.batch_first
        self.fused = module._qkv_same_embed_dim
        self._warned = False

    @staticmethod
    def attribute_overrides() -> dict[str, Any]:
        # nn.TransformerEncoderLayer's fused inference kernel reads self_attn's weights directly and would run
        # every head; a False here sends it to self_attn's forward, which is ours.
        return {"_qkv_same_embed_dim": False}

    @staticmethod
    def prepare(model: nn.Module) -> None:
        # nn.TransformerEncoder's inference path packs padded batches into nested tensors before the layers.
        for m in model.modules():
            if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False):
                m.use_nested_tensor = False
                m.__dict__["_condcomp_disabled_nested"] = True

    @staticmethod
    def restore(model: nn.Module) -> None:
        for m in model.modules():
            if isinstance(m, nn.TransformerEncoder) and m.__dict__.pop("_condcomp_disabled_nested", False):
                m.use_nested_tensor = True

    def weights(self, owner: Any) -> AttentionWeights:
        D = self.layout.d_model
        if self.fused:
            w = owner.in_proj_weight
            q, k, v = w[:D], w[D:2 * D], w[2 * D:]
        else:
            q, k, v = owner.q_proj_weight, owner.k_proj_weight, owner.v_proj_weight
        b = owner.in_proj_bias
        qb, kb, vb = (None, None, None) if b is None else (b[:D], b[D:2 * D], b[2 * D:])
        ow, ob = linear_parts(owner.out_proj, "out_proj")
        return AttentionWeights(self.layout, q, k, v, ow, qb, kb, vb, ob)

    def forward(self, routed: RoutedAttention, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, None]:
        if need_weights and not self._warned:
            warnings.warn("condcomp does not compute attention weights; need_weights=True returns None for them",
                          stacklevel=3)
            self._warned = True
        self_attention = key is query and value is query
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError("nn.MultiheadAttention query, key and value must all be (T, D) or all 3-D "
                             f"({'(B, T, D)' if self.batch_first else '(T, B, D)'}), got {tuple(query.shape)}, "
                             f"{tuple(key.shape)}, {tuple(value.shape)}")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, T = query.shape[:2]
        S = key.shape[1]
        check_mask_dtype(key_padding_mask, "key_padding_mask")
        check_mask_dtype(attn_mask, "attn_mask")
        key_mask = bias = None
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (B, S):
                raise ValueError(f"key_padding_mask must be (B, S) = {(B, S)}, got {tuple(key_padding_mask.shape)}")
            if key_padding_mask.dtype == torch.bool:
                key_mask = ~key_padding_mask
            else:
                bias = key_padding_mask.to(query.dtype)[:, None, None, :]  # (B, 1, 1, S)
        if attn_mask is not None:
            H = self.layout.num_heads
            if tuple(attn_mask.shape) not in ((T, S), (B * H, T, S)):
                raise ValueError(f"attn_mask must be (T, S) = {(T, S)} or (B*H, T, S) = {(B * H, T, S)}, "
                                 f"got {tuple(attn_mask.shape)}")
            m = _additive(attn_mask, query.dtype)
            m = m[None, None] if m.dim() == 2 else m.view(B, self.layout.num_heads, T, S)
            bias = m if bias is None else bias + m
        elif is_causal:
            bias = causal_bias(T, S, query.device, query.dtype)
        y = routed.attend_parts(query, key=None if self_attention else key,  # (B, T, D)
                                value=None if self_attention or value is key else value,
                                mask=key_mask if self_attention else None, key_mask=key_mask, attn_bias=bias)
        if unbatched:
            y = y.squeeze(0)
        elif not self.batch_first:
            y = y.transpose(0, 1)
        return y, None
