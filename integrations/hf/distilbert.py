"""DistilBERT: ``DistilBertSelfAttention`` (``q_lin``/``k_lin``/``v_lin``/``out_lin``).

transformers 5 hands it the same 4-D mask as BERT (``create_bidirectional_mask``: bool for sdpa, additive for
eager), not DistilBERT 4.x's ``(B, S)`` 0/1 mask with its own masked_fill; the residual and ``sa_layer_norm``
stay in ``TransformerBlock``, outside the wrapped module.
"""

from __future__ import annotations

from typing import Any

from condcomp.adapters import register_adapter

from .common import import_classes
from .plain import PlainSelfAttentionAdapter


@register_adapter
class DistilBertAttentionAdapter(PlainSelfAttentionAdapter):
    """``DistilBertSelfAttention``: bidirectional self-attention, no cache."""

    module_types = import_classes([("transformers.models.distilbert.modeling_distilbert", "DistilBertSelfAttention")])
    projections = ("q_lin", "k_lin", "v_lin", "out_lin")

    @staticmethod
    def facts(module: Any) -> tuple[int, float, float]:
        return int(module.n_heads), float(module.scaling), float(module.dropout.p)
