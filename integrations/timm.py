"""timm's ``Attention`` (``timm.layers.Attention``: the self-attention of VisionTransformer, DeiT, ...).

Layout: one fused ``qkv`` Linear (rows ``[q; k; v]``, head ``h`` owning rows ``h*Dh:(h+1)*Dh`` of each third),
``proj`` Linear, ``attn_drop``/``proj_drop``. ``fused_attn`` only chooses timm's kernel (SDPA or the explicit
softmax); both compute the same attention, which the executor now computes instead, so the wrapped module gives
the same result whichever way ``fused_attn`` is set (tests cover both). Refused with the reason: ``qk_norm``,
``scale_norm`` and ``gated`` attention (extra per-head operations the executors do not apply).

Importing this module imports timm (``import condcomp`` does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from timm.layers import Attention as TimmAttention
from torch import Tensor, nn

from condcomp.adapters import AttentionAdapter, register_adapter
from condcomp.masks import additive_bias, attended_keys, causal_bias, check_mask_dtype
from condcomp.projections import linear_parts, projection_problem
from condcomp.types import AttentionWeights, HeadLayout

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


@register_adapter
class TimmAttentionAdapter(AttentionAdapter):
    """``timm.layers.Attention``: ``forward(x, attn_mask=None, is_causal=False) -> (B, N, dim_out)``.

    ``attn_mask`` follows SDPA: bool (True = may attend) or additive float, broadcastable to ``(B, H, N, N)``.
    """

    module_types = (TimmAttention,)

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        for attr in ("q_norm", "k_norm", "norm"):
            if not isinstance(getattr(module, attr, nn.Identity()), nn.Identity):
                return (f"{attr} is a {type(getattr(module, attr)).__name__} (qk_norm / scale_norm); condcomp's "
                        "executors do not apply per-head normalisation")
        if getattr(module, "gate", None) is not None:
            return "gated=True multiplies the attention output by a learned gate; not supported"
        for name in ("qkv", "proj"):
            problem = projection_problem(getattr(module, name, None))
            if problem is not None:
                return f"{name}: {problem}"
        return None

    def __init__(self, module: Any) -> None:
        H, Dh = int(module.num_heads), int(module.head_dim)
        self.layout = HeadLayout(d_model=module.qkv.in_features, num_heads=H, num_kv_heads=H, head_dim=Dh,
                                 scale=float(module.scale), dropout_p=float(module.attn_drop.p))
        self.attn_dim = H * Dh

    def weights(self, owner: Any) -> AttentionWeights:
        A = self.attn_dim
        w, b = linear_parts(owner.qkv, "qkv")
        ow, ob = linear_parts(owner.proj, "proj")
        qb, kb, vb = (None, None, None) if b is None else (b[:A], b[A:2 * A], b[2 * A:])
        return AttentionWeights(self.layout, w[:A], w[A:2 * A], w[2 * A:], ow, qb, kb, vb, ob)

    def forward(self, routed: RoutedAttention, x: Tensor, attn_mask: Tensor | None = None,
                is_causal: bool = False) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"timm Attention input must be (B, N, C), got {tuple(x.shape)}")
        B, N, _ = x.shape
        bias = query_mask = None
        if is_causal:  # as in timm: is_causal wins over attn_mask
            bias = causal_bias(N, N, x.device, x.dtype)
        elif attn_mask is not None:
            check_mask_dtype(attn_mask, "attn_mask")
            if attn_mask.dtype == torch.bool:
                allowed, bias = attn_mask, additive_bias(attn_mask, x.dtype)
            else:
                allowed, bias = ~torch.isneginf(attn_mask), attn_mask
            # A patch that no query may attend is padding (NaFlex): the policy pools over the others.
            query_mask = attended_keys(allowed, B, N)  # (B, N)
        return routed.proj_drop(routed.attend_parts(x, mask=query_mask, attn_bias=bias))  # (B, N, dim_out)
