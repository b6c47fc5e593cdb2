"""CLIP and SigLIP: ``CLIPAttention`` and ``SiglipAttention`` in the text and vision towers.

Both are ``q_proj``/``k_proj``/``v_proj``/``out_proj`` self-attention without a cache. The modules themselves are
not causal (``is_causal = False``); CLIP's text tower passes ``is_causal=True`` on every call (and a causal 4-D mask
when there is padding), which the shared adapter turns into a causal bias. SigLIP's vision pooling head is an
``nn.MultiheadAttention`` (condcomp's torch integration wraps it too).
"""

from __future__ import annotations

from typing import Any

from condcomp.adapters import register_adapter

from .common import import_classes
from .plain import PlainSelfAttentionAdapter


@register_adapter
class ClipAttentionAdapter(PlainSelfAttentionAdapter):
    """``CLIPAttention`` / ``SiglipAttention``: one head width ``embed_dim // num_heads``, scale ``module.scale``."""

    module_types = import_classes([("transformers.models.clip.modeling_clip", "CLIPAttention"),
                                    ("transformers.models.siglip.modeling_siglip", "SiglipAttention")])
    projections = ("q_proj", "k_proj", "v_proj", "out_proj")

    @staticmethod
    def facts(module: Any) -> tuple[int, float, float]:
        return int(module.num_heads), float(module.scale), float(module.dropout or 0.0)
