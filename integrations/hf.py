"""Hugging Face transformers 5.x: module-swap adapters for the BERT family, ViT and Llama-family decoders.

Two structural families cover the supported classes:

- **BERT-style** (``BertAttention``, ``RobertaAttention``): the wrapped module owns ``.self`` (``query``/``key``/
  ``value``) and ``.output`` (``dense`` -> dropout -> ``LayerNorm(. + residual)``); the adapter replays that output
  block exactly, so a row with no active head becomes ``LayerNorm(residual)``.
- **Projection-style** (``ViTAttention``, ``LlamaAttention``, ``Qwen2Attention``, ``MistralAttention``):
  ``q_proj``/``k_proj``/``v_proj``/``o_proj``, grouped-query heads, rotary ``position_embeddings=(cos, sin)``,
  optional sliding window and KV cache.

A class is recognised when it is one of the known classes (or one registered with
:func:`register_transformers_attention`) *and* its parameters have exactly the expected structure; anything else
is refused with the reason. Importing this module imports transformers (``import condcomp`` does not).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from condcomp.adapters import AttentionAdapter, register_adapter
from condcomp.attention import linear_weights
from condcomp.masks import check_mask_dtype
from condcomp.projections import linear_parts
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout
from condcomp.versions import tensor_version

if TYPE_CHECKING:
    from condcomp.routed import RoutedAttention

# (module, class) pairs tried at import; classes absent from the installed transformers are skipped.
_BERT_CLASSES = [("transformers.models.bert.modeling_bert", "BertAttention"),
                 ("transformers.models.roberta.modeling_roberta", "RobertaAttention")]
_PROJ_CLASSES = [("transformers.models.vit.modeling_vit", "ViTAttention"),
                 ("transformers.models.llama.modeling_llama", "LlamaAttention"),
                 ("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),
                 ("transformers.models.mistral.modeling_mistral", "MistralAttention"),
                 ("transformers.models.mixtral.modeling_mixtral", "MixtralAttention"),  # Mistral's attention
                 ("transformers.models.gemma.modeling_gemma", "GemmaAttention")]  # head_dim may differ from D/H


def _import_classes(table: list[tuple[str, str]]) -> tuple[type, ...]:
    found = []
    for module_name, cls_name in table:
        try:
            found.append(getattr(importlib.import_module(module_name), cls_name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _param_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# Masks: transformers hands attention modules a 4-D bool (sdpa) or additive float (eager) mask, a 2-D padding
# mask (flash attention) or None. The derived forms are cached for the last mask seen, because every layer of a
# forward receives the same tensor and the reduction below is O(B*T*S).
_LAST_MASK: list[Any] = [None]  # one (mask, key, parts) tuple, replaced whole (safe if threads share the model)


def _mask_parts(mask: Any, B: int, T: int, S: int, self_attention: bool) -> tuple[Tensor | None, Tensor | None,
                                                                                  Tensor | None]:
    """``(query_mask (B,T) | None, key_mask (B,S) | None, attn_bias | None)`` from a transformers attention mask."""
    if mask is None:
        return None, None, None
    # Keyed by identity and version: a mask edited in place between forwards is derived again.
    key = (T, S, self_attention, tensor_version(mask) if isinstance(mask, Tensor) else None)
    cached = _LAST_MASK[0]
    if cached is not None and cached[0] is mask and cached[1] == key and key[3] is not None:
        return cached[2]  # type: ignore[no-any-return]
    if not isinstance(mask, Tensor):
        raise TypeError(f"condcomp received an attention mask of type {type(mask).__name__} (flex attention's "
                        "BlockMask?); load or set the model with attn_implementation='sdpa' or 'eager'")
    if mask.dim() == 2:  # flash-attention style (B, S) padding mask, 1 = real token
        if tuple(mask.shape) != (B, S):
            raise ValueError(f"2-D attention mask must be (B, S) = {(B, S)}, got {tuple(mask.shape)}")
        key_mask = mask.bool()
        parts: tuple[Tensor | None, ...] = (key_mask[:, S - T:] if self_attention else None, key_mask, None)
    elif mask.dim() == 4:
        check_mask_dtype(mask, "a 4-D attention_mask")
        if mask.dtype == torch.bool:
            allowed = mask
            bias = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        else:
            # eager masks use the dtype's most negative finite number, not -inf (rows stay finite, as in HF)
            allowed = mask > torch.finfo(mask.dtype).min / 2
            bias = mask
        key_ok = allowed.any(dim=1).any(dim=1).expand(B, S)  # (B, S): a key some query may attend
        query_mask = key_ok[:, S - T:] if self_attention and S >= T else None
        parts = (query_mask, None, bias)
    else:
        raise ValueError(f"attention mask must be 2-D (B, S) or 4-D (B, 1, T, S), got shape {tuple(mask.shape)}")
    _LAST_MASK[0] = (mask, key, parts)
    return parts  # type: ignore[return-value]


def _sliding_bias(T: int, S: int, window: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Additive ``(1, 1, T, S)`` bias forbidding keys more than ``window`` positions back (bottom-right aligned)."""
    i = torch.arange(T, device=device).unsqueeze(1) + (S - T)
    j = torch.arange(S, device=device).unsqueeze(0)
    return torch.zeros(T, S, device=device, dtype=dtype).masked_fill(j <= i - window, float("-inf"))[None, None]


@functools.cache
def _signature(module_cls: Any) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(module_cls.forward))


def _bind(module_cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The original forward's arguments by name (``past_key_values`` is the pre-5.40 name of ``cache``)."""
    kwargs = dict(kwargs)
    if "past_key_values" in kwargs and "cache" not in kwargs:
        kwargs["cache"] = kwargs.pop("past_key_values")
    sig = _signature(module_cls)
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop(next(iter(sig.parameters)))  # self
    extra = {}
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            extra = named.pop(name, {})
    named["kwargs"] = extra
    return named


class _TransformersAdapter(AttentionAdapter):
    """Shared parts: class + structure matching and the ``attn_implementation`` check."""

    required: set[str] = set()

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        return isinstance(module, cls.module_types) if cls.module_types else False

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        raise NotImplementedError

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        problem = cls.structure_problem(module)
        if problem is not None:
            return (f"{type(module).__qualname__} does not have the structure condcomp's transformers adapter "
                    f"expects ({problem}); this transformers version may have changed it")
        config = getattr(module, "config", None) or getattr(getattr(module, "self", None), "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and "flex" in str(impl):
            return (f"attn_implementation={impl!r} passes BlockMasks; use 'sdpa' or 'eager' "
                    "(model.set_attn_implementation('sdpa'))")
        return None


@register_adapter
class BertStyleAttentionAdapter(_TransformersAdapter):
    """``BertAttention`` / ``RobertaAttention`` (self- and cross-attention, decoder KV cache)."""

    module_types = _import_classes(_BERT_CLASSES)

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        core, out = getattr(module, "self", None), getattr(module, "output", None)
        if core is None or out is None:
            return "no .self / .output children"
        prefixes = {n.split(".")[0] for n in _param_names(core)}
        if prefixes != {"query", "key", "value"}:
            return f".self has parameters under {sorted(prefixes)}, expected only query/key/value"
        prefixes = {n.split(".")[0] for n in _param_names(out)}
        if prefixes != {"dense", "LayerNorm"} or _param_names(out.LayerNorm) != {"weight", "bias"}:
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
        a = _bind(self.module_cls, args, kwargs)
        x: Tensor = a["hidden_states"]
        cache, extra = a.get("cache"), a["kwargs"]
        core = routed.self
        B, T = x.shape[:2]
        key_states = value_states = None
        if self.cross:
            enc = a.get("encoder_hidden_states")
            if enc is None:
                raise ValueError(f"{self.module_cls.__name__} is a cross-attention module: encoder_hidden_states "
                                 "is required")
            mask = a.get("encoder_attention_mask")
            if cache is not None and cache.is_updated.get(self.layer_idx):
                layer = cache.cross_attention_cache.layers[self.layer_idx]
                key_states, value_states = layer.keys, layer.values
            elif cache is not None:
                k, v = self._kv(core, enc)
                key_states, value_states = cache.cross_attention_cache.update(k, v, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
            S = enc.shape[1] if key_states is None else key_states.shape[2]
        else:
            enc, mask = None, a.get("attention_mask")
            if cache is not None:
                # Per-token plans cannot shrink a KV cache later tokens may read: every head's K/V is cached.
                current = getattr(cache, "self_attention_cache", cache)
                k, v = self._kv(core, x)
                key_states, value_states = current.update(k, v, self.layer_idx, kwargs=extra)
            S = T if key_states is None else key_states.shape[2]
        query_mask, key_mask, bias = _mask_parts(mask, B, T, S, not self.cross)
        inputs = AttentionInputs(
            x=x, key=enc if key_states is None else None, mask=query_mask, key_mask=key_mask, attn_bias=bias,
            key_states=key_states, value_states=value_states,
            dropout_p=self.layout.dropout_p if routed.training else 0.0,
        )
        y = routed.attend(inputs)  # (B, T, D), output bias included on rows with an active head
        out = routed.output
        return out.LayerNorm(out.dropout(y) + x), None


@register_adapter
class ProjectionAttentionAdapter(_TransformersAdapter):
    """``ViTAttention``, ``LlamaAttention``, ``Qwen2Attention``, ``MistralAttention``: q/k/v/o projections, GQA,
    rotary ``position_embeddings``, sliding window, KV cache (``cache`` / ``past_key_values``)."""

    module_types = _import_classes(_PROJ_CLASSES)

    @classmethod
    def structure_problem(cls, module: nn.Module) -> str | None:
        names = _param_names(module)
        prefixes = {n.split(".")[0] for n in names}
        if prefixes != {"q_proj", "k_proj", "v_proj", "o_proj"}:
            return f"parameters under {sorted(prefixes)}, expected only q_proj/k_proj/v_proj/o_proj"
        if not hasattr(module, "head_dim"):
            return "no head_dim attribute"
        for attr in ("attn_logit_softcapping", "q_norm", "k_norm"):
            if getattr(module, attr, None) is not None:
                return f"{attr} is set (not supported)"
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
        return linear_weights(owner, self.layout)

    def forward(self, routed: RoutedAttention, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        a = _bind(self.module_cls, args, kwargs)
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
        key_states = value_states = None
        if cache is not None:
            # Every key/value head is projected and cached: a head a token skips now may be chosen by a later one.
            # The projections' own forward: exact for LoRA layers too.
            k = routed.k_proj(x).view(B, T, L.num_kv_heads, L.head_dim)
            v = routed.v_proj(x).view(B, T, L.num_kv_heads, L.head_dim)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, Dh)
            if rotary is not None:
                from condcomp.masks import apply_rotary

                k = apply_rotary(k, *rotary)
            key_states, value_states = cache.update(k, v, self.layer_idx, kwargs=extra)
        S = T if key_states is None else key_states.shape[2]
        mask = a.get("attention_mask")
        query_mask, key_mask, bias = _mask_parts(mask, B, T, S, True)
        if mask is None and self.sliding_window is not None and S > self.sliding_window:
            bias = _sliding_bias(T, S, int(self.sliding_window), x.device, x.dtype)
        inputs = AttentionInputs(
            x=x, mask=query_mask, key_mask=key_mask, attn_bias=bias, rotary=rotary,
            key_states=key_states, value_states=value_states, dropout_p=L.dropout_p if routed.training else 0.0,
        )
        return routed.attend(inputs), None


# Adapters of further architectures, one module each; imported here because they use the helpers above.
from condcomp.integrations import hf_clip, hf_distilbert, hf_gpt2, hf_t5  # noqa: E402,F401


def register_transformers_attention(cls: type, family: str) -> None:
    """Make ``apply_`` wrap another transformers attention class that copies a supported one.

    ``family`` is ``"bert"`` (``.self`` + ``.output`` like ``BertAttention``) or ``"projection"``
    (``q_proj``/``k_proj``/``v_proj``/``o_proj`` like ``LlamaAttention``). The structure is still checked per
    module, so a class that only looks similar is refused with the reason rather than silently mis-computed.

    >>> from transformers.models.electra.modeling_electra import ElectraAttention  # doctest: +SKIP
    >>> register_transformers_attention(ElectraAttention, "bert")  # doctest: +SKIP
    """
    adapters: dict[str, type[_TransformersAdapter]] = {"bert": BertStyleAttentionAdapter,
                                                       "projection": ProjectionAttentionAdapter}
    if family not in adapters:
        raise ValueError(f"family must be one of {sorted(adapters)}, got {family!r}")
    adapter = adapters[family]
    if cls not in adapter.module_types:
        adapter.module_types = (*adapter.module_types, cls)


def supported_transformers_classes() -> list[str]:
    """Names of the transformers attention classes the module swap recognises."""
    return sorted(t.__name__ for a in (BertStyleAttentionAdapter, ProjectionAttentionAdapter) for t in a.module_types)
