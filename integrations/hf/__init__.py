"""Hugging Face transformers 5.x: module-swap adapters for the BERT family, ViT and Llama-family decoders.

Two structural families cover the supported classes:

- **BERT-style** (``BertAttention``, ``RobertaAttention``): the wrapped module owns ``.self`` (``query``/``key``/
  ``value``) and ``.output`` (``dense`` -> dropout -> ``LayerNorm(. + residual)``); the adapter replays that output
  block exactly, so a row with no active head becomes ``LayerNorm(residual)``.
- **Projection-style** (``ViTAttention``, ``LlamaAttention``, ``Qwen2Attention``, ``MistralAttention``,
  ``MixtralAttention``, ``GemmaAttention``): ``q_proj``/``k_proj``/``v_proj``/``o_proj``, grouped-query heads,
  rotary ``position_embeddings=(cos, sin)``, optional sliding window and KV cache.

Other architectures have their own modules, imported from here: :mod:`.gpt2`, :mod:`.t5`,
:mod:`.distilbert`, :mod:`.clip` (CLIP and SigLIP); the helpers they share with this module are in
:mod:`.common`.

A class is recognised when it is one of the known classes (or one registered with
:func:`register_transformers_attention`) *and* its parameters have exactly the expected structure; anything else
is refused with the reason. Importing this module imports transformers (``import condcomp`` does not).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from condcomp.adapters import register_adapter
from condcomp.attention import linear_weights
from condcomp.projections import linear_parts
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout

# The other architectures' adapters, one module each (they share common.py's helpers with the two families here).
from . import clip, distilbert, gpt2, t5  # noqa: F401
from .cache import open_step, request_plan
from .common import (
    TransformersAdapter,
    bind_arguments,
    cross_attention_states,
    decoder_request_plan,
    import_classes,
    mask_parts,
    parameter_names,
    sliding_window_bias,
    visible_keys,
)
from .decode import compact_selection, decide_request_plan, held_attention

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention

# (module, class) pairs tried at import; classes absent from the installed transformers are skipped.
_BERT_CLASSES = [("transformers.models.bert.modeling_bert", "BertAttention"),
                 ("transformers.models.roberta.modeling_roberta", "RobertaAttention")]
_PROJ_CLASSES = [("transformers.models.vit.modeling_vit", "ViTAttention"),
                 ("transformers.models.llama.modeling_llama", "LlamaAttention"),
                 ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),
                 ("transformers.models.qwen3.modeling_qwen3", "Qwen3Attention"),  # + per-head q_norm/k_norm
                 ("transformers.models.mistral.modeling_mistral", "MistralAttention"),
                 ("transformers.models.mixtral.modeling_mixtral", "MixtralAttention"),  # Mistral's attention
                 ("transformers.models.gemma.modeling_gemma", "GemmaAttention")]  # head_dim may differ from D/H


@register_adapter
class BertStyleAttentionAdapter(TransformersAdapter):
    """``BertAttention`` / ``RobertaAttention`` (self- and cross-attention, decoder KV cache)."""

    module_types = import_classes(_BERT_CLASSES)

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
        core = owner.self
        (qw, qb), (kw, kb), (vw, vb) = (linear_parts(getattr(core, n), f"self.{n}") for n in ("query", "key", "value"))
        ow, ob = linear_parts(owner.output.dense, "output.dense")
        return AttentionWeights(self.layout, qw, kw, vw, ow, qb, kb, vb, ob)

    def _kv(self, core: Any, source: Tensor) -> tuple[Tensor, Tensor]:
        shape = (*source.shape[:-1], -1, self.layout.head_dim)
        return (core.key(source).view(shape).transpose(1, 2),  # (B, H, S, Dh)
                core.value(source).view(shape).transpose(1, 2))

    def forward(self, routed: RoutedAttention, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        a = bind_arguments(self.module_cls, args, kwargs)
        x: Tensor = a["hidden_states"]
        cache, extra = a.get("cache"), a["kwargs"]
        core = routed.self
        B, T = x.shape[:2]
        key_states = value_states = None
        step = plan = None
        q0 = None
        if self.cross:
            enc = a.get("encoder_hidden_states")
            if enc is None:
                raise ValueError(f"{self.module_cls.__name__} is a cross-attention module: encoder_hidden_states "
                                 "is required")
            mask = a.get("encoder_attention_mask")
            if cache is not None and self.layer_idx is not None:
                step = open_step(routed, cache, self.layer_idx, B, T, cross=True)
            key_states, value_states = cross_attention_states(cache, self.layer_idx, lambda: self._kv(core, enc))
            S = enc.shape[1] if key_states is None else key_states.shape[2]
        else:
            enc, mask = None, a.get("attention_mask")
            if cache is not None:
                # The request's plan is decided (or read from the cache) before the cache grows; per-token plans
                # cannot shrink a KV cache later tokens may read: every head's K/V is cached.
                if self.layer_idx is not None:
                    step = open_step(routed, cache, self.layer_idx, B, T)
                    q0 = step.query_start
                    plan = decoder_request_plan(routed, step, x, mask)
                current = getattr(cache, "self_attention_cache", cache)
                k, v = self._kv(core, x)
                key_states, value_states = current.update(k, v, self.layer_idx, kwargs=extra)
                if q0 is not None:
                    key_states, value_states = visible_keys(key_states, value_states, mask, q0, T)
            S = T if key_states is None else key_states.shape[2]
        query_mask, key_mask, bias = mask_parts(mask, B, T, S, not self.cross, q0)
        inputs = AttentionInputs(
            x=x, key=enc if key_states is None else None, mask=query_mask, key_mask=key_mask, attn_bias=bias,
            key_states=key_states, value_states=value_states,
            dropout_p=self.layout.dropout_p if routed.training else 0.0,
        )
        if plan is None:
            plan = request_plan(routed, step, x, query_mask, S, decoder=self.cross or self.layout.causal)
        y = routed.attend(inputs, plan)  # (B, T, D), output bias included on rows with an active head
        if step is not None:
            step.keep(routed, plan, None)
        out = routed.output
        return out.LayerNorm(out.dropout(y) + x), None


@register_adapter
class ProjectionAttentionAdapter(TransformersAdapter):
    """``ViTAttention``, ``LlamaAttention``, ``Qwen2Attention``, ``Qwen3Attention``, ``MistralAttention``, ...:
    q/k/v/o projections, GQA, per-head q/k norms (Qwen3), rotary ``position_embeddings``, sliding window, KV cache
    (``cache`` / ``past_key_values``)."""

    module_types = import_classes(_PROJ_CLASSES)

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
        self.sliding_window = getattr(module, "sliding_window", None)
        self.module_cls = type(module)

    def weights(self, owner: Any) -> AttentionWeights:
        w = linear_weights(owner, self.layout)
        q_norm, k_norm = getattr(owner, "q_norm", None), getattr(owner, "k_norm", None)
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
        step = plan = None
        if cache is not None and self.layer_idx is not None:
            # A decoder's sequence plan is its request's: stored in the cache at the first call, read at the later
            # ones. In inference (or whenever the cache holds one) only the key/value groups it keeps are projected,
            # cached and read; a per-token plan, or a plan decided in training, caches every key/value head.
            step = open_step(routed, cache, self.layer_idx, B, T)
            held = step.held
            if held is not None and held.selection is not None:
                return held_attention(routed, held.selection, x, rotary, step, mask, self.sliding_window, extra), None
            plan = decide_request_plan(routed, x, mask, step)
            if held is None and plan.granularity == "sequence" and not routed.training:
                selection = compact_selection(routed, plan, step)
                y = held_attention(routed, selection, x, rotary, step, mask, self.sliding_window, extra)
                step.keep(routed, plan, selection)
                return y, None
        key_states = value_states = None
        if cache is not None:
            # Every key/value head is projected and cached: a head a token skips now may be chosen by a later one.
            # The projections' own forward: exact for LoRA layers too.
            k = routed.k_proj(x).view(B, T, L.num_kv_heads, L.head_dim)
            if getattr(routed, "k_norm", None) is not None:  # Qwen3: per-head norm before rotary
                k = routed.k_norm(k)
            v = routed.v_proj(x).view(B, T, L.num_kv_heads, L.head_dim)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, Dh)
            if rotary is not None:
                from condcomp.masks import apply_rotary

                k = apply_rotary(k, *rotary)
            key_states, value_states = cache.update(k, v, self.layer_idx, kwargs=extra)
            if step is not None:
                key_states, value_states = visible_keys(key_states, value_states, mask, step.query_start, T)
        S = T if key_states is None else key_states.shape[2]
        q0 = None if step is None else step.query_start
        query_mask, key_mask, bias = mask_parts(mask, B, T, S, True, q0)
        if mask is None and self.sliding_window is not None and S > self.sliding_window:
            bias = sliding_window_bias(T, S, int(self.sliding_window), x.device, x.dtype)
        inputs = AttentionInputs(
            x=x, mask=query_mask, key_mask=key_mask, attn_bias=bias, rotary=rotary,
            key_states=key_states, value_states=value_states, dropout_p=L.dropout_p if routed.training else 0.0,
        )
        if plan is None:
            plan = request_plan(routed, None, x, query_mask, S, decoder=L.causal)
        y = routed.attend(inputs, plan)
        if step is not None:
            step.keep(routed, plan, None)
        return y, None


def register_transformers_attention(cls: type, family: str) -> None:
    """Make ``apply_`` wrap another transformers attention class that copies a supported one.

    ``family`` is ``"bert"`` (``.self`` + ``.output`` like ``BertAttention``) or ``"projection"``
    (``q_proj``/``k_proj``/``v_proj``/``o_proj`` like ``LlamaAttention``). The structure is still checked per
    module, so a class that only looks similar is refused with the reason rather than silently mis-computed.

    >>> from transformers.models.electra.modeling_electra import ElectraAttention  # doctest: +SKIP
    >>> register_transformers_attention(ElectraAttention, "bert")  # doctest: +SKIP
    """
    adapters: dict[str, type[TransformersAdapter]] = {"bert": BertStyleAttentionAdapter,
                                                       "projection": ProjectionAttentionAdapter}
    if family not in adapters:
        raise ValueError(f"family must be one of {sorted(adapters)}, got {family!r}")
    adapter = adapters[family]
    if cls not in adapter.module_types:
        adapter.module_types = (*adapter.module_types, cls)


def supported_transformers_classes() -> list[str]:
    """Names of the transformers attention classes the module swap recognises (every family)."""
    from condcomp.adapters import registered_adapters

    return sorted({t.__name__ for a in registered_adapters() for t in a.module_types
                   if t.__module__.startswith("transformers.")})


def __getattr__(name: str) -> Any:
    # The Trainer callback imports transformers' trainer machinery: only when asked for.
    if name == "CondCompCallback":
        from .trainer import CondCompCallback

        return CondCompCallback
    if name in ("checkpoint", "interface", "trainer"):  # submodules a user reaches as attributes
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
