"""Projection-style attention: ``ViTAttention`` and the Llama-family decoders (``LlamaAttention``, ``Qwen2Attention``,
``Qwen3Attention``, ``MistralAttention``, ``MixtralAttention``, ``GemmaAttention``; classes registered as
``"projection"``).

``q_proj``/``k_proj``/``v_proj``/``o_proj``, grouped-query heads, optional per-head ``q_norm``/``k_norm`` (Qwen3),
rotary ``position_embeddings=(cos, sin)``, optional sliding window and KV cache. This adapter only translates
arguments: with a cache, it hands the base decoder sequence (:func:`.decode.decoder_attention`) its projections,
rotary and sliding window; for a sequence plan at inference only the key/value groups it keeps are cached and read.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from condcomp.adapters import register_adapter
from condcomp.attention import linear_weights
from condcomp.dense import split_heads
from condcomp.types import AttentionWeights, HeadLayout, Projections

from .common import (
    TransformersAdapter,
    attend_call,
    bind_arguments,
    cache_every_head,
    import_classes,
    parameter_names,
    sliding_window_bias,
)
from .decode import DecoderCall, decoder_attention

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention

# (module, class) pairs tried at import; classes absent from the installed transformers are skipped.
PROJECTION_CLASSES = [("transformers.models.vit.modeling_vit", "ViTAttention"),
                 ("transformers.models.llama.modeling_llama", "LlamaAttention"),
                 ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),
                 ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),  # + per-head q_norm/k_norm
                 ("transformers.models.mistral.modeling_mistral", "MistralAttention"),
                 ("transformers.models.mixtral.modeling_mixtral", "MixtralAttention"),  # Mistral's attention
                 ("transformers.models.gemma.modeling_gemma", "GemmaAttention")]  # head_dim may differ from D/H


def _child(owner: nn.Module, name: str) -> Any:
    """``owner``'s per-head norm ``name`` (Qwen3's ``q_norm``/``k_norm``: child modules, which the wrapper holds as
    its own) or None. Read from the module table, not with ``getattr(owner, name, None)``: where there is none
    (Llama; every decode step of every layer) that passes through the wrapper's fallback to the original module
    and raises twice before answering None."""
    found = owner._modules.get(name)
    return found if found is not None else owner.__dict__.get(name)


@register_adapter
class ProjectionAttentionAdapter(TransformersAdapter):
    """``ViTAttention``, ``LlamaAttention``, ``Qwen2Attention``, ``Qwen3Attention``, ``MistralAttention``, ...:
    q/k/v/o projections, GQA, per-head q/k norms (Qwen3), rotary ``position_embeddings``, sliding window, KV cache
    (``cache`` / ``past_key_values``)."""

    module_types = import_classes(PROJECTION_CLASSES)
    holds_kv_policies = True  # its decoders' calls on a cache run on the compact cache (.decode)

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        names = parameter_names(module)
        prefixes = {n.split(".")[0] for n in names}
        projections = {"q_proj", "k_proj", "v_proj", "o_proj"}
        if prefixes not in (projections, projections | {"q_norm", "k_norm"}):
            return (f"parameters under {sorted(prefixes)}, expected q_proj/k_proj/v_proj/o_proj (and optionally "
                    "q_norm/k_norm)")
        if not hasattr(module, "head_dim"):
            return "no head_dim attribute"
        if getattr(module, "attn_logit_softcapping", None) is not None:
            return "attn_logit_softcapping is set (not supported)"
        Dh = int(getattr(module, "head_dim"))  # noqa: B009 (nn.Module's type hides the attribute)
        for attr in ("q_norm", "k_norm"):  # per-head norms over Dh (Qwen3): every parameter has Dh entries
            norm = getattr(module, attr, None)
            if norm is not None and any(p.shape != (Dh,) for p in norm.parameters()):
                return f"{attr} has parameters of shapes {[tuple(p.shape) for p in norm.parameters()]}, not (Dh,)"
        return None

    def __init__(self, module: Any) -> None:
        Dh = int(module.head_dim)
        H = module.q_proj.out_features // Dh
        Hkv = module.k_proj.out_features // Dh
        self.layout = HeadLayout(
            d_model=module.q_proj.in_features, num_heads=H, num_kv_heads=Hkv, head_dim=Dh,
            scale=float(getattr(module, "scaling", Dh**-0.5)), causal=bool(getattr(module, "is_causal", False)),
            dropout_p=float(getattr(module, "attention_dropout", 0.0) or 0.0),
        )
        self.layer_idx = getattr(module, "layer_idx", None)
        # the layer's own window: its attribute (Qwen2/3: None on full-attention layers), else the config's
        # (Mistral, Mixtral pass config.sliding_window to the attention function on every layer)
        config_window = getattr(getattr(module, "config", None), "sliding_window", None)
        self.sliding_window = getattr(module, "sliding_window", config_window)
        self.module_cls = type(module)

    def weights(self, owner: Any) -> AttentionWeights:
        w = linear_weights(owner, self.layout)
        q_norm, k_norm = _child(owner, "q_norm"), _child(owner, "k_norm")
        return w if q_norm is None and k_norm is None else dataclasses.replace(w, q_norm=q_norm, k_norm=k_norm)

    def forward(self, routed: RoutedAttention, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        a = bind_arguments(self.module_cls, args, kwargs)
        x: Tensor = a["hidden_states"]
        cache, extra = a.get("cache"), a["kwargs"]
        B, T = x.shape[:2]
        L = self.layout
        rotary = None
        if "position_embeddings" in a and a["position_embeddings"] is None:
            raise ValueError(f"{self.module_cls.__name__} needs position_embeddings=(cos, sin) (its rotary "
                             "embedding); the model's forward computes them")
        if a.get("position_embeddings") is not None:
            cos, sin = a["position_embeddings"]
            rotary = (cos.expand(B, T, L.head_dim), sin.expand(B, T, L.head_dim))  # (B, T, Dh), views
        mask = a.get("attention_mask")
        if cache is not None and self.layer_idx is not None:  # a request's call: the base decoder sequence
            m: dict[str, Any] = routed._modules  # from the module table (PEFT's LoRA layers too): exact for LoRA
            proj = Projections(m["q_proj"], m["k_proj"], m["v_proj"], m["o_proj"], _child(routed, "q_norm"),
                               _child(routed, "k_norm"))
            call = DecoderCall(x, cache, self.layer_idx, mask, extra, proj, rotary, self.sliding_window,
                               weights=self.weights(routed))
            return decoder_attention(routed, call), None
        key_states = value_states = None
        if cache is not None:  # a cache on a layer without layer_idx: every head appended, no request plan
            # The projections' own forward: exact for LoRA layers too.
            k = split_heads(routed.k_proj(x), L.head_dim, _child(routed, "k_norm"), rotary)  # (B, Hkv, T, Dh)
            v = split_heads(routed.v_proj(x), L.head_dim)
            key_states, value_states = cache_every_head(cache, self.layer_idx, k, v, extra)
        S = T if key_states is None else key_states.shape[2]
        band = None
        if mask is None and self.sliding_window is not None and S > self.sliding_window:
            band = sliding_window_bias(T, S, int(self.sliding_window), x.device, x.dtype)
        y = attend_call(routed, x, mask, decoder=L.causal, key_states=key_states, value_states=value_states,
                        rotary=rotary, extra_bias=band)
        return y, None
