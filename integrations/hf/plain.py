"""Shared adapter of transformers self-attention modules with four named projections and no KV cache.

DistilBERT (``q_lin``/``k_lin``/``v_lin``/``out_lin``), CLIP and SigLIP (``q_proj``/``k_proj``/``v_proj``/
``out_proj``) compute ``out(attention(q(x), k(x), v(x), mask))`` and return ``(output, attn_weights)``; a subclass
names the projections and reads the head count, head width, scale and dropout (:mod:`.distilbert`,
:mod:`.clip`). ``attn_weights`` is None, as in transformers' sdpa path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from condcomp.masks import causal_bias
from condcomp.projections import linear_parts
from condcomp.types import AttentionWeights, HeadLayout

from .common import TransformersAdapter, attend_call, bind_arguments, parameter_names

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


class PlainSelfAttentionAdapter(TransformersAdapter):
    """Base: ``projections`` = (q, k, v, out) child names; subclasses implement :meth:`facts`."""

    projections: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "out_proj")

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        prefixes = {n.split(".")[0] for n in parameter_names(module)}
        if prefixes != set(cls.projections):
            return f"parameters under {sorted(prefixes)}, expected only {'/'.join(cls.projections)}"
        return None

    @staticmethod
    def facts(module: Any) -> tuple[int, float, float]:
        """``(num_heads, scale, attention dropout p)`` of ``module``."""
        raise NotImplementedError

    def __init__(self, module: Any) -> None:
        H, scale, dropout_p = self.facts(module)
        q, k = (getattr(module, n) for n in self.projections[:2])
        self.layout = HeadLayout(
            d_model=q.in_features, num_heads=H, num_kv_heads=k.out_features * H // q.out_features,
            head_dim=q.out_features // H, scale=scale, causal=bool(getattr(module, "is_causal", False)),
            dropout_p=dropout_p,
        )
        self.module_cls = type(module)

    def weights(self, owner: Any) -> AttentionWeights:
        (qw, qb), (kw, kb), (vw, vb), (ow, ob) = (linear_parts(getattr(owner, n), n) for n in self.projections)
        return AttentionWeights(self.layout, qw, kw, vw, ow, qb, kb, vb, ob)

    def forward(self, routed: RoutedAttention, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        a = bind_arguments(self.module_cls, args, kwargs)
        x: Tensor = a["hidden_states"]
        T = x.shape[1]
        # CLIP's text tower asks its (non-causal) attention modules for causal attention per call: is_causal=True
        causal = bool(a["kwargs"].get("is_causal", self.layout.causal))
        if self.layout.causal and not causal:
            raise ValueError(f"{self.module_cls.__name__} is causal; condcomp cannot run it with is_causal=False")
        band = causal_bias(T, T, x.device, x.dtype) if causal and not self.layout.causal else None
        return attend_call(routed, x, a.get("attention_mask"), extra_bias=band), None
