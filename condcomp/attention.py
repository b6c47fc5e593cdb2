"""HeadAttention: condcomp's own attention module in the canonical per-head layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from condcomp.adapters import AttentionAdapter, register_adapter
from condcomp.dense import all_heads_attention
from condcomp.projections import linear_parts
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


class HeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention with separate q/k/v/o projections.

    Dense by itself; ``condcomp.apply_`` turns it into a :class:`~condcomp.RoutedAttention`.

    >>> attn = HeadAttention(d_model=32, num_heads=4)
    >>> attn(torch.randn(2, 5, 32), mask=torch.ones(2, 5, dtype=torch.bool)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = d_model // num_heads
        self.layout = HeadLayout(
            d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            scale=scale if scale is not None else head_dim**-0.5, causal=causal, dropout_p=dropout,
            kdim=kdim, vdim=vdim,
        )
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(kdim or d_model, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or kdim or d_model, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)

    def weights(self) -> AttentionWeights:
        """Views of this module's parameters in the canonical layout."""
        return linear_weights(self, self.layout)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_mask: Tensor | None = None,
        attn_bias: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
        condition: Tensor | None = None,
    ) -> Tensor:
        """``x (B, T, D)``; ``mask (B, T)`` True = real token (also the key mask for self-attention).

        ``condition (B, Dc)``: a per-example conditioning vector (a diffusion model's timestep and class
        embedding). Dense attention ignores it; once routed, a policy that declares ``reads_condition`` receives it.
        """
        inputs = native_inputs(self.layout, x, mask, key, value, key_mask, attn_bias, rotary, self.training)
        out, dead = all_heads_attention(self.weights(), inputs)  # (B, H, T, Dh)
        y = self.o_proj(out.transpose(1, 2).flatten(2))
        return y if dead is None else y.masked_fill(dead.unsqueeze(-1), 0.0)


def linear_weights(owner: Any, layout: HeadLayout) -> AttentionWeights:
    """Canonical weights of a module with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` linear children."""
    # children read from the module table: a wrapper's attribute fallback is not on every decode step's path
    children: dict[str, Any] = owner._modules if isinstance(owner, nn.Module) else {}
    (qw, qb), (kw, kb), (vw, vb), (ow, ob) = (
        linear_parts(children[n] if children.get(n) is not None else getattr(owner, n), n)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    return AttentionWeights(layout, qw, kw, vw, ow, qb, kb, vb, ob)


def native_inputs(
    layout: HeadLayout, x: Tensor, mask: Tensor | None, key: Tensor | None, value: Tensor | None,
    key_mask: Tensor | None, attn_bias: Tensor | None, rotary: tuple[Tensor, Tensor] | None, training: bool,
) -> AttentionInputs:
    if key is None and key_mask is None:
        key_mask = mask
    return AttentionInputs(
        x=x, key=key, value=value, mask=mask, key_mask=key_mask, attn_bias=attn_bias, rotary=rotary,
        dropout_p=layout.dropout_p if training else 0.0,
    )


@register_adapter
class HeadAttentionAdapter(AttentionAdapter):
    """condcomp's own :class:`HeadAttention`."""

    module_types = (HeadAttention,)

    def __init__(self, module: nn.Module) -> None:
        assert isinstance(module, HeadAttention)
        self.layout = module.layout

    def weights(self, owner: Any) -> AttentionWeights:
        return linear_weights(owner, self.layout)

    def forward(self, routed: RoutedAttention, x: Tensor, mask: Tensor | None = None, *args: Any,
                **kwargs: Any) -> Tensor:
        names = ("key", "value", "key_mask", "attn_bias", "rotary", "condition")
        extra = dict(zip(names, args), **kwargs)
        inputs = native_inputs(self.layout, x, mask, extra.get("key"), extra.get("value"), extra.get("key_mask"),
                               extra.get("attn_bias"), extra.get("rotary"), routed.training)
        return routed.attend(inputs, condition=extra.get("condition"))


