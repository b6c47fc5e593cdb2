"""BERT-style attention: ``BertAttention``, ``RobertaAttention`` (and classes registered as ``"bert"``).

The wrapped module owns ``.self`` (``query``/``key``/``value``) and ``.output`` (``dense`` -> dropout ->
``LayerNorm(. + residual)``); the adapter replays that output block exactly, so a row with no active head becomes
``LayerNorm(residual)``. Self-attention and cross-attention (``is_cross_attention``, an ``EncoderDecoderCache``).
A decoder's (``is_decoder=True``) self-attention on a KV cache runs the base decoder sequence
(:func:`.decode.decoder_attention`): the compact per-request cache and every KV policy; an encoder's and the
cross-attention refuse a policy that keeps unkept groups (they hold no request's growing cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from condcomp.adapters import register_adapter
from condcomp.dense import split_heads
from condcomp.projections import linear_parts
from condcomp.types import AttentionWeights, HeadLayout, Projections

from .cache import open_step
from .common import (
    TransformersAdapter,
    attend_call,
    bind_arguments,
    cache_every_head,
    cross_attention_states,
    import_classes,
    parameter_names,
)
from .decode import DecoderCall, decoder_attention, refuse_kv_policy_outside_decoder

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention

# (module, class) pairs tried at import; classes absent from the installed transformers are skipped.
BERT_CLASSES = [("transformers.models.bert.modeling_bert", "BertAttention"),
                 ("transformers.models.roberta.modeling_roberta", "RobertaAttention")]


@register_adapter
class BertStyleAttentionAdapter(TransformersAdapter):
    """``BertAttention`` / ``RobertaAttention`` (self- and cross-attention, decoder KV cache)."""

    module_types = import_classes(BERT_CLASSES)
    holds_kv_policies = True  # a decoder's self-attention calls on a cache run on the compact cache (.decode)

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        core, out = getattr(module, "self", None), getattr(module, "output", None)
        if core is None or out is None:
            return "no .self / .output children"
        prefixes = {n.split(".")[0] for n in parameter_names(core)}
        if prefixes != {"query", "key", "value"}:
            return f".self has parameters under {sorted(prefixes)}, expected only query/key/value"
        prefixes = {n.split(".")[0] for n in parameter_names(out)}
        if prefixes != {"dense", "LayerNorm"} or parameter_names(out.LayerNorm) != {"weight", "bias"}:
            return f".output has parameters under {sorted(prefixes)}, expected dense and LayerNorm (weight, bias)"
        if not hasattr(core, "attention_head_size") or not hasattr(core, "num_attention_heads"):
            return ".self lacks num_attention_heads / attention_head_size"
        return None

    def __init__(self, module: Any) -> None:
        core = module.self
        Dh, H = int(core.attention_head_size), int(core.num_attention_heads)
        self.cross = bool(getattr(module, "is_cross_attention", False))
        kdim = core.key.in_features
        self.layout = HeadLayout(
            d_model=core.query.in_features, num_heads=H, num_kv_heads=H, head_dim=Dh,
            scale=float(getattr(core, "scaling", Dh**-0.5)), causal=bool(getattr(core, "is_causal", False)),
            dropout_p=float(core.dropout.p), kdim=None if kdim == core.query.in_features else kdim,
        )
        self.layer_idx = getattr(core, "layer_idx", None)
        self.module_cls = type(module)

    def weights(self, owner: Any) -> AttentionWeights:
        m: dict[str, Any] = owner._modules  # the module table (no attribute fallback of a wrapper)
        core, output = m["self"], m["output"]
        (qw, qb), (kw, kb), (vw, vb) = (linear_parts(getattr(core, n), f"self.{n}") for n in ("query", "key", "value"))
        ow, ob = linear_parts(output.dense, "output.dense")
        return AttentionWeights(self.layout, qw, kw, vw, ow, qb, kb, vb, ob)

    def _kv(self, core: Any, source: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's keys and values ``(B, H, S, Dh)`` of ``source``: the projections' own forward."""
        Dh = self.layout.head_dim
        return split_heads(core.key(source), Dh), split_heads(core.value(source), Dh)

    def forward(self, routed: RoutedAttention, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        a = bind_arguments(self.module_cls, args, kwargs)
        x: Tensor = a["hidden_states"]
        cache, extra = a.get("cache"), a["kwargs"]
        B, T = x.shape[:2]
        enc: Tensor | None = None
        key_states: Tensor | None = None
        value_states: Tensor | None = None
        step = None
        if self.cross or not self.layout.causal:
            refuse_kv_policy_outside_decoder(routed, "cross-attention" if self.cross else "an encoder's self-attention")
        if self.cross:
            enc = a.get("encoder_hidden_states")
            if enc is None:
                raise ValueError(f"{self.module_cls.__name__} is a cross-attention module: encoder_hidden_states "
                                 "is required")
            mask = a.get("encoder_attention_mask")
            if cache is not None and self.layer_idx is not None:
                step = open_step(routed, cache, self.layer_idx, B, T, cross=True)
            key_states, value_states = cross_attention_states(cache, self.layer_idx,
                                                              lambda: self._kv(routed.self, enc))
            y = attend_call(routed, x, mask, self_attention=False, step=step, decoder=True,
                            key=enc if key_states is None else None, key_states=key_states, value_states=value_states)
        else:
            mask = a.get("attention_mask")
            if cache is not None and self.layer_idx is not None:  # a request's call: the base decoder sequence
                core: Any = routed._modules["self"]
                output: Any = routed._modules["output"]
                proj = Projections(core.query, core.key, core.value, output.dense)  # exact for LoRA
                y = decoder_attention(routed, DecoderCall(x, cache, self.layer_idx, mask, extra, proj,
                                                          weights=self.weights(routed)))
            else:
                if cache is not None:  # a cache on a layer without layer_idx: every head appended, no request plan
                    key_states, value_states = cache_every_head(cache, self.layer_idx, *self._kv(routed.self, x),
                                                                extra)
                y = attend_call(routed, x, mask, decoder=self.layout.causal, key_states=key_states,
                                value_states=value_states)  # (B, T, D), output bias on active rows
        out: Any = routed._modules["output"]
        return out.LayerNorm(out.dropout(y) + x), None
