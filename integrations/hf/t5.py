"""T5: ``T5Attention`` (``q``/``k``/``v``/``o`` without biases), encoder and decoder self-attention, cross-attention.

T5 adds a per-head relative position bias ``(1, H, T, S)`` to the scores and does not scale them (``scaling = 1``).
The first layer of each stack owns ``relative_attention_bias`` and computes the bias; the stack hands it to every
later layer through ``position_bias``. The wrapped module returns what ``T5Attention`` returns,
``(output, position_bias, attn_weights)`` with the bias unmasked, so wrapped and unwrapped layers can be mixed.
The bias reaches the executors as ``attn_bias`` (per head), added to the padding/causal mask. KV cache: decoder
self-attention runs the base decoder sequence (:func:`.decode.decoder_attention`: the compact per-request cache,
the bias as its score term) under every KV policy: a policy with a state of its own (``window``, ``snapkv``,
``adakv``) adds to each kept key the bias of its true distance from the query
(:class:`~condcomp.kv.position_bias.RelativeBias`); one that cannot (``reads_position_bias`` unset) is refused at
``apply_``. Cross-attention computes every head's keys once (``is_updated``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from condcomp.adapters import register_adapter
from condcomp.dense import split_heads
from condcomp.kv.position_bias import RelativeBias
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


@register_adapter
class T5AttentionAdapter(TransformersAdapter):
    """``T5Attention``: self- or cross-attention (decided per call by ``key_value_states``, as in T5)."""

    module_types = import_classes([("transformers.models.t5.modeling_t5", "T5Attention")])
    # the decoder self-attention's calls on a cache run on the compact cache (.decode); a KV policy's own state
    # gets the position bias as a RelativeBias, so only policies that read it are accepted (condcomp.kv.choose)
    holds_kv_policies = True
    adds_position_bias = True

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        want = {"q", "k", "v", "o", *(("relative_attention_bias",) if module.has_relative_attention_bias else ())}
        prefixes = {n.split(".")[0] for n in parameter_names(module)}
        if prefixes != want:
            return f"parameters under {sorted(prefixes)}, expected only {'/'.join(sorted(want))}"
        if float(getattr(module, "scaling", 1.0)) != 1.0:
            return f"scaling={module.scaling} (T5 does not scale its scores)"
        return None

    def __init__(self, module: Any) -> None:
        H, Dh = int(module.n_heads), int(module.key_value_proj_dim)
        self.layout = HeadLayout(
            d_model=int(module.d_model), num_heads=H, num_kv_heads=H, head_dim=Dh, scale=1.0,
            causal=bool(module.is_causal), dropout_p=float(module.dropout),
        )
        self.layer_idx = module.layer_idx
        self.module_cls = type(module)
        self.decoder = bool(getattr(module, "is_decoder", False))

    def held_record(self, cache: Any) -> Any:
        return super().held_record(cache) if self.decoder else None  # an encoder's layers hold no request plan

    def cross_attention(self) -> bool:
        return not self.layout.causal  # a decoder's non-causal T5Attention is its cross-attention

    def weights(self, owner: Any) -> AttentionWeights:
        m: dict[str, Any] = owner._modules  # the table: no wrapper's attribute fallback on a decode step
        (qw, qb), (kw, kb), (vw, vb), (ow, ob) = (linear_parts(m[n], n) for n in "qkvo")
        return AttentionWeights(self.layout, qw, kw, vw, ow, qb, kb, vb, ob)

    def _kv(self, routed: Any, source: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's keys and values ``(B, H, S, Dh)`` of ``source``: the projections' own forward."""
        Dh = self.layout.head_dim
        m: dict[str, Any] = routed._modules  # the table: no wrapper's attribute fallback on a decode step
        return split_heads(m["k"](source), Dh), split_heads(m["v"](source), Dh)

    def _position_bias(self, routed: Any, T: int, S: int, x: Tensor, past: Any) -> Tensor:
        """What T5Attention computes when no layer before it did: ``(1, H, T, S)``."""
        if not routed.base.has_relative_attention_bias:  # the original's flag (read as data)
            return torch.zeros(1, self.layout.num_heads, T, S, device=x.device, dtype=x.dtype)
        # T5's own method on the wrapper: it reads the relative_attention_bias child the wrapper holds
        bias: Tensor = self.module_cls.compute_bias(routed, T, S, device=x.device, past_seen_tokens=past)
        return bias

    def forward(self, routed: RoutedAttention, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, None]:
        a = bind_arguments(self.module_cls, args, kwargs)
        x: Tensor = a["hidden_states"]
        enc: Tensor | None = a.get("key_value_states")
        cache: Any = a.get("cache")
        extra, mask = a["kwargs"], a.get("mask")
        cross = enc is not None
        if cross and self.layout.causal:
            raise ValueError(f"{self.module_cls.__name__} is causal self-attention (is_causal=True); condcomp cannot "
                             "run it as cross-attention")
        if cross or not self.decoder:
            refuse_kv_policy_outside_decoder(routed, "cross-attention" if cross else "an encoder's self-attention")
        B, T = x.shape[:2]
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0  # before this call's update
        past = past.clone() if isinstance(past, Tensor) else past
        position_bias = a.get("position_bias")
        if not cross and cache is not None:  # a request's call: the base decoder sequence (the compact cache)
            m: dict[str, Any] = routed._modules  # the modules (from the table): exact for LoRA
            proj = Projections(m["q"], m["k"], m["v"], m["o"])
            call = DecoderCall(x, cache, self.layer_idx, mask, extra, proj, weights=self.weights(routed))
            if position_bias is None:
                position_bias = self._position_bias(routed, T, call.num_keys(past), x, past)
            # its last query's distances; a static cache's count stays on the device (a compiled step reads no host
            # count, and the table's shape does not change from step to step)
            relative = RelativeBias.from_scores(position_bias, past + T - 1)
            call = dataclasses.replace(call, score_bias=position_bias,  # (1, H, T, S), added to the mask's
                                       relative_bias=relative)
            return decoder_attention(routed, call), position_bias, None
        step = open_step(routed, cache, self.layer_idx, B, T, cross=True) if cache is not None else None
        key_states = value_states = None
        if enc is not None:
            key_states, value_states = cross_attention_states(cache, self.layer_idx, lambda: self._kv(routed, enc),
                                                              extra)
        S = (x if enc is None else enc).shape[1] if key_states is None else key_states.shape[2]
        if position_bias is None:
            position_bias = self._position_bias(routed, T, S, x, past)
        y = attend_call(routed, x, mask, self_attention=not cross, step=step, decoder=self.decoder,
                        key=enc if key_states is None else None, key_states=key_states, value_states=value_states,
                        extra_bias=position_bias)  # position bias (B|1, H, T, S) plus the mask's
        return y, position_bias, None
