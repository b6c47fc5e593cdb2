"""GPT-2: ``GPT2Attention`` (fused ``c_attn`` and ``c_proj``, transformers' ``Conv1D`` layers, weight ``(in, out)``).

Self-attention reads q, k, v as the three row blocks of ``c_attn.weight.T`` (views; see condcomp.projections for
Conv1D and LoRA on it); cross-attention (``add_cross_attention=True``) reads q from ``q_attn`` and k, v from the two
blocks of its ``c_attn``. ``scaling`` already folds ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx``
(1/sqrt(Dh), then / (layer_idx + 1)). ``reorder_and_upcast_attn`` only acts under eager attention, where it computes
the scores in float32 whatever the model's dtype: refused for models in other dtypes rather than computed differently
(a float32 model computes the same scores).

Self-attention on a KV cache runs the base decoder sequence (:func:`.decode.decoder_attention`): the compact
per-request cache and every KV policy. Cross-attention caches every head of the encoder's keys (a KV policy that
keeps unkept groups is refused there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from condcomp.adapters import register_adapter
from condcomp.dense import kv_heads
from condcomp.projections import linear_parts
from condcomp.types import AttentionWeights, HeadLayout, Projections

from .cache import open_step
from .common import (
    TransformersAdapter,
    attend_call,
    bind_arguments,
    cross_attention_states,
    import_classes,
    parameter_names,
)
from .decode import DecoderCall, decoder_attention, refuse_kv_policy_outside_decoder

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention


def _upcast_problem(module: Any, dtype: torch.dtype) -> str | None:
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if getattr(module, "reorder_and_upcast_attn", False) and impl == "eager" and dtype != torch.float32:
        return (f"reorder_and_upcast_attn=True under eager attention computes the attention scores in float32, "
                f"not in the model's {dtype}, which condcomp's executors do not reproduce; use "
                "attn_implementation='sdpa' (where transformers ignores the option), a float32 model, or set it False")
    return None


@register_adapter
class GPT2AttentionAdapter(TransformersAdapter):
    """``GPT2Attention``: causal self-attention with KV cache, or cross-attention (``is_cross_attention``)."""

    module_types = import_classes([("transformers.models.gpt2.modeling_gpt2", "GPT2Attention")])
    holds_kv_policies = True  # its self-attention's calls on a cache run on the compact cache (.decode)

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        want = {"c_attn", "c_proj", *(("q_attn",) if getattr(module, "is_cross_attention", False) else ())}
        prefixes = {n.split(".")[0] for n in parameter_names(module)}
        if prefixes != want:
            return f"parameters under {sorted(prefixes)}, expected only {'/'.join(sorted(want))}"
        if not hasattr(module, "scaling") or not hasattr(module, "head_dim"):
            return "no scaling / head_dim attributes"
        return None

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        dtype = next(module.parameters()).dtype
        return super().unsupported_reason(module) or _upcast_problem(module, dtype)

    def __init__(self, module: Any) -> None:
        D, H, Dh = int(module.embed_dim), int(module.num_heads), int(module.head_dim)
        self.cross = bool(module.is_cross_attention)
        self.layout = HeadLayout(
            d_model=D, num_heads=H, num_kv_heads=H, head_dim=Dh, scale=float(module.scaling),
            causal=bool(module.is_causal), dropout_p=float(module.attn_dropout.p),
        )
        self.layer_idx = module.layer_idx
        self.module_cls = type(module)

    def weights(self, owner: Any) -> AttentionWeights:
        m: dict[str, Any] = owner._modules  # the table: no wrapper's attribute fallback on a decode step
        w, b = linear_parts(m["c_attn"], "c_attn")  # (3D, D) self-attention (q, k, v), (2D, D) cross (k, v)
        ow, ob = linear_parts(m["c_proj"], "c_proj")
        n = 2 if self.cross else 3
        ws, bs = w.chunk(n), [None] * n if b is None else b.chunk(n)  # row blocks: views
        if self.cross:
            qw, qb = linear_parts(m["q_attn"], "q_attn")
            return AttentionWeights(self.layout, qw, ws[0], ws[1], ow, qb, bs[0], bs[1], ob)
        return AttentionWeights(self.layout, ws[0], ws[1], ws[2], ow, bs[0], bs[1], bs[2], ob)

    def forward(self, routed: RoutedAttention, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        a = bind_arguments(self.module_cls, args, kwargs)
        x: Tensor = a["hidden_states"]
        problem = _upcast_problem(routed.base, x.dtype)  # implementation and dtype can change after wrapping
        if problem is not None:
            raise ValueError(f"{self.module_cls.__name__}: {problem}")
        cache, extra = a.get("cache"), a["kwargs"]
        B, T = x.shape[:2]
        enc = a.get("encoder_hidden_states")
        if enc is not None and not self.cross:
            raise ValueError(f"{self.module_cls.__name__} is a self-attention module (is_cross_attention=False) "
                             "but was given encoder_hidden_states")
        key_states = value_states = None
        step = None
        if self.cross:
            if enc is None:
                raise ValueError(f"{self.module_cls.__name__} is a cross-attention module: encoder_hidden_states "
                                 "is required")
            refuse_kv_policy_outside_decoder(routed, "cross-attention")
            mask = a.get("encoder_attention_mask")
            if cache is not None:
                step = open_step(routed, cache, self.layer_idx, B, T, cross=True)
            key_states, value_states = cross_attention_states(cache, self.layer_idx,
                                                              lambda: kv_heads(routed.weights(), enc, enc))
        else:
            mask = a.get("attention_mask")
            if cache is not None:  # a request's call: the base decoder sequence (the compact cache, a KV policy)
                m: dict[str, Any] = routed._modules  # the modules (from the table): exact for LoRA
                D = self.layout.d_model
                proj = Projections.fused(m["c_attn"], m["c_proj"], (D, D, D))
                call = DecoderCall(x, cache, self.layer_idx, mask, extra, proj, weights=self.weights(routed))
                return m["resid_dropout"](decoder_attention(routed, call)), None
        y = attend_call(routed, x, mask, self_attention=not self.cross, step=step, decoder=True,
                        key=enc if key_states is None else None, key_states=key_states, value_states=value_states)
        return routed.resid_dropout(y), None
