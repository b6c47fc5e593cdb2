"""The attention-function attachment: a ``"condcomp"`` attention function in transformers' ``AttentionInterface``,
no module swap.

Routing attaches to a model in one of two ways (its *attachment*): the module swap (``condcomp.apply_`` replaces
each attention module by a ``RoutedAttention``) or this one. transformers 5 lets a model call any registered
attention function on its already-projected ``q``/``k``/``v``; this attachment registers one that routes heads and
computes only the selected (example, head) pairs, and attaches the policy and router to each attention module as a
``condcomp_core`` child (so the routing parameters live in the model's ``state_dict``, under
``...condcomp_core.condcomp_policy.*``).

What it saves, compared with the module swap (``condcomp.apply_``):

- only the attention core (``QK^T``, softmax, ``AV``) of skipped heads, and only for sequence plans; the
  q/k/v and output projections stay dense (the function receives all heads' projections). Token plans run the
  core densely and gate it (no saving; use the module swap and the gathered executor).
- the output projection's bias is added for every row, even one with no active head (module swap: only rows
  with at least one active head).

The mask function registered beside it is transformers' ``sdpa_mask`` (4-D bool masks).

>>> cfg = CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk")
>>> names = apply_interface_(model, cfg)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from condcomp.adapters import find_adapter, load_integrations_for
from condcomp.api import aux_loss, head_usage, select_targets, set_progress
from condcomp.config import CondCompConfig
from condcomp.host import RoutingHost
from condcomp.kv.choose import check_kv_support
from condcomp.notices import Notices
from condcomp.routed import build_routing, read_adapter
from condcomp.types import HeadLayout, HeadPlan

from .bert import BertStyleAttentionAdapter
from .common import mask_parts, warn_if_attentions_requested
from .internals import forward_uses_attention_interface
from .projection import ProjectionAttentionAdapter

ATTN_NAME = "condcomp"


class CoreRouting(RoutingHost):
    """Policy + router attached to one attention module by the attention-function attachment."""

    def __init__(self, policy: Any, router: Any, adapter: Any, owner: nn.Module) -> None:
        super().__init__()
        self.adapter = adapter
        self.attach_routing(policy, router)
        object.__setattr__(self, "_owner", owner)  # not a submodule: it is our parent's parent (no cycle)
        self._x: Tensor | None = None
        self.hook: Any = None

    def capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._x = args[0] if args else kwargs["hidden_states"]


def _core_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, plan: HeadPlan,
                    scale: float | None, dropout: float, is_causal: bool) -> Tensor:
    """Gated attention of the plan's heads, ``(B, T, H, Dh)``; sequence plans compute only the active pairs."""
    B, H, T, Dh = query.shape
    group = H // key.shape[1]
    if plan.granularity == "sequence":
        rows, heads = plan.active.nonzero(as_tuple=True)  # (P,) each
        m = None
        if mask is not None:
            m = mask[rows if mask.shape[0] > 1 else torch.zeros_like(rows),
                     heads if mask.shape[1] > 1 else torch.zeros_like(heads)].unsqueeze(1)  # (P, 1, T, S)
        sel = F.scaled_dot_product_attention(
            query[rows, heads].unsqueeze(1), key[rows, heads // group].unsqueeze(1),
            value[rows, heads // group].unsqueeze(1), attn_mask=m, dropout_p=dropout, is_causal=is_causal,
            scale=scale,
        ).squeeze(1)  # (P, T, Dh)
        gates = plan.gates[rows, heads].to(sel.dtype)[:, None, None]
        out = query.new_zeros(B, H, T, Dh).index_put((rows, heads), sel * gates)
    else:
        k = key.repeat_interleave(group, dim=1) if group > 1 else key
        v = value.repeat_interleave(group, dim=1) if group > 1 else value
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                             scale=scale)  # (B, H, T, Dh)
        out = out * plan.gates.transpose(1, 2).unsqueeze(-1).to(out.dtype)
    return out.transpose(1, 2).contiguous()  # (B, T, H, Dh)


def condcomp_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                       scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """The function registered as ``attn_implementation="condcomp"`` (modules without routing run plain SDPA)."""
    routing = module._modules.get("condcomp_core")
    if isinstance(routing, CoreRouting) and routing.condcomp_disabled:
        routing._x = None  # condcomp.disabled(model): plain SDPA below
    if not isinstance(routing, CoreRouting) or routing.condcomp_disabled:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # type: ignore[no-any-return]
    warn_if_attentions_requested(kwargs)
    x, routing._x = routing._x, None
    if x is None:
        raise RuntimeError("condcomp_attention: the attention module's input was not captured (was the module "
                           "called through its forward?)")
    for name in ("softcap", "s_aux", "sinks"):  # what SDPA itself refuses, or would add to the softmax
        if kwargs.get(name) is not None:
            raise ValueError(f"condcomp's attention function does not support {name}= ({type(module).__name__}); "
                             "use the module swap (condcomp.apply_) where an adapter exists, or attn_implementation="
                             "'eager' without condcomp")
    B, H, T, _ = query.shape
    S = key.shape[2]
    query_mask, key_mask, _ = mask_parts(attention_mask, B, T, S, not getattr(routing.adapter, "cross", False))
    mask = attention_mask if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4 else None
    if mask is None and key_mask is not None:
        mask = key_mask[:, None, None, :]  # (B, 1, 1, S)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal
    if kwargs.get("position_bias") is not None:  # T5-style relative position bias: folded into the mask as SDPA does
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        mask = create_position_bias_mask(kwargs["position_bias"], mask, bool(causal and T > 1), query, key)
    is_causal = bool(T > 1 and mask is None and causal)
    weights = routing.adapter.weights(routing._owner)
    plan = routing.route(x, query_mask, weights if weights is not None else ProjectedQueries(routing.layout, query),  # type: ignore[arg-type]
                         S)
    out = _core_attention(query, key, value, mask, plan, scaling, dropout if module.training else 0.0, is_causal)
    return out, None


def register() -> None:
    """Register ``"condcomp"`` in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, condcomp_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _set_impl(model: nn.Module, name: str) -> None:
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


class ProjectedQueries:
    """What a router may ask of a module's weights (``project_queries``), answered from the queries transformers
    already projected for the attention function: the norm router then needs no adapter for the module."""

    def __init__(self, layout: HeadLayout, query: Tensor) -> None:
        self.layout, self._query = layout, query  # (B, H, T, Dh)

    def project_queries(self, x: Tensor, rotary: Any = None) -> Tensor:
        # Rotary embeddings rotate pairs of coordinates: per-head norms are the same before and after them.
        return self._query.transpose(1, 2)  # (B, T, H, Dh)


class InterfaceLayoutAdapter:
    """The head layout of an attention module known only through its config: enough to route it (the attention
    function receives the projected q/k/v; nothing else is read)."""

    def __init__(self, module: nn.Module, name: str = "module") -> None:
        config = getattr(module, "config", None)
        H = _first_int(module, config, ("num_heads", "num_attention_heads", "n_heads", "n_head"))
        D = _first_int(config, module, ("hidden_size", "d_model", "dim", "n_embd", "embed_dim"))
        if H is None or D is None:
            raise ValueError(f"cannot wrap {name} ({type(module).__qualname__}): cannot read its number of heads "
                             "and width from its attributes or config; wrap it with condcomp.apply_ and an "
                             "AttentionAdapter (docs/extending.md)")
        Dh = _first_int(module, config, ("head_dim", "attention_head_size", "key_value_proj_dim", "d_kv")) or D // H
        Hkv = _first_int(module, config, ("num_key_value_heads",)) or H
        self.layout = HeadLayout(d_model=D, num_heads=H, num_kv_heads=Hkv, head_dim=Dh, scale=Dh**-0.5)
        self.cross = bool(getattr(module, "is_cross_attention", False))

    def weights(self, owner: Any) -> None:
        return None


def _first_int(a: Any, b: Any, names: tuple[str, ...]) -> int | None:
    for source in (a, b):
        for name in names:
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def dispatches_through_interface(module: nn.Module) -> bool:
    """Whether the module's forward calls transformers' attention function registry (``AttentionInterface``)."""
    return forward_uses_attention_interface(type(module))


def _interface_targets(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, Any]]:
    """(name, the attention module, the module that calls the attention function, its adapter): the module swap's
    transformers adapters where one fits (their weights serve every router), any other module that dispatches
    through the interface otherwise."""
    found: list[tuple[str, nn.Module, nn.Module, Any]] = []
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if find_adapter(module) in (BertStyleAttentionAdapter, ProjectionAttentionAdapter):
            adapter = read_adapter(module, name)  # the module swap's checks and errors, naming the layer
            core = module.self if isinstance(adapter, BertStyleAttentionAdapter) else module
            found.append((name, module, core, adapter))
            claimed.add(id(core))
        elif id(module) not in claimed and dispatches_through_interface(module):
            found.append((name, module, module, InterfaceLayoutAdapter(module, name)))
    return found


def apply_interface_(model: nn.Module, config: CondCompConfig | None = None) -> list[str]:
    """Attach routing to the attention modules of a transformers model and switch it to the ``"condcomp"``
    attention function; returns the attention module names. Undo with :func:`remove_interface_`.

    Every module that dispatches through transformers' ``AttentionInterface`` is routed, whatever its
    architecture; routers that read weights (``norm``) get the queries transformers projected."""
    config = config or CondCompConfig()
    register()
    load_integrations_for(model)
    if cores(model):
        raise ValueError("model already routed through the AttentionInterface; call remove_interface_ first")
    found = _interface_targets(model)
    selected = set(select_targets([target[0] for target in found], config))
    chosen = [target for target in found if target[0] in selected]
    if not chosen:
        raise ValueError("apply_interface_ matched no attention module that dispatches through transformers' "
                         f"AttentionInterface; target_modules={config.target_modules}")
    check_kv_support(config, [(target[0], None) for target in chosen], "apply_interface_")
    shared, notices = None, Notices()  # the layers share one: each warning once per model
    for name, module, core, adapter in chosen:
        device = next(core.parameters()).device
        policy, router = build_routing(config, adapter, device, name, shared)
        if config.share_policy:
            shared = policy
        routing = CoreRouting(policy, router, adapter, module).to(device)
        routing.__dict__["condcomp_notices"] = notices
        core.add_module("condcomp_core", routing)
        routing.hook = core.register_forward_pre_hook(routing.capture, with_kwargs=True)
    previous = {getattr(getattr(m, "config", None), "_attn_implementation", None) for m in model.modules()} - {None}
    model.__dict__["_condcomp_previous_attn"] = previous.pop() if len(previous) == 1 else "sdpa"
    _set_impl(model, ATTN_NAME)
    return [target[0] for target in chosen]


def cores(model: nn.Module) -> dict[str, CoreRouting]:
    """Every attached :class:`CoreRouting` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, CoreRouting)}


def remove_interface_(model: nn.Module) -> list[str]:
    """Detach the routing and restore the model's previous attention implementation."""
    found = cores(model)
    if not found:
        raise ValueError("remove_interface_: the model has no condcomp_core (was apply_interface_ called?)")
    for name, routing in found.items():
        routing.hook.remove()
        parent = model.get_submodule(name.rpartition(".")[0])
        del parent._modules["condcomp_core"]
    _set_impl(model, model.__dict__.pop("_condcomp_previous_attn", "sdpa"))
    return list(found)


# The core statistics under this module's names: one code path serves both attachments.
interface_head_usage = head_usage
interface_aux_loss = aux_loss
interface_set_progress = set_progress
