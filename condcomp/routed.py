"""RoutedAttention: an attention module plus a budget policy, a router and an executor."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.adapters import AttentionAdapter, find_adapter, supported_classes
from condcomp.config import CondCompConfig
from condcomp.executors.auto import resolve_executor
from condcomp.held_plans import KVSelection
from condcomp.host import RoutingHost
from condcomp.notices import Notices
from condcomp.projections import ProjectionError
from condcomp.registry import POLICIES, ROUTERS
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout, HeadPlan


class RoutedAttention(RoutingHost):
    """A wrapped attention module whose heads are chosen per input (or per token).

    It holds the original module's parameters, buffers and children under their original names (so
    ``state_dict`` keys, optimisers and ``from_pretrained`` keep working), answers the original call
    signature, and adds ``condcomp_policy`` and ``condcomp_router``. ``condcomp.remove_`` puts the original
    module back.

    >>> import condcomp
    >>> layer = condcomp.HeadAttention(32, 4)
    >>> routed = condcomp.RoutedAttention.wrap(layer, condcomp.CondCompConfig(policy="full", router="random"))
    >>> routed(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    base: nn.Module  # the original module (its parameters are the ones this module trains)

    def __init__(self, base: nn.Module, adapter: AttentionAdapter, policy: Any, router: Any,
                 executor: str = "auto", check_inputs: bool = False) -> None:
        super().__init__()
        for name, p in base.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in base.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in base._non_persistent_buffers_set)
        for name, child in base.named_children():
            self.add_module(name, child)
        self.adapter = adapter
        self.attach_routing(policy, router)
        self.executor = executor
        self.check_inputs = check_inputs
        self.condcomp_config: Any = None  # the CondCompConfig it was built from (set by apply_; not `config`,
        # which third-party attention modules use for their own)
        for attr, value in adapter.attribute_overrides().items():
            object.__setattr__(self, attr, value)
        # Set last, and deliberately not as a submodule (its parts are registered above): before this line the
        # attribute fallback below is off, so registration cannot mistake the original's attributes for ours.
        object.__setattr__(self, "_base", base)
        # the original module (its parameters are the ones this module trains), held as data so reading it calls
        # nothing (adapters read it on every call)
        object.__setattr__(self, "base", base)
        self.train(base.training)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("base", self.__dict__.get("_base"))  # pickled when `base` was a property

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Code around the module reads its configuration (num_heads, batch_first, head_dim, ...).
            base = self.__dict__.get("_base")
            if base is None or name.startswith("__"):
                raise
            return getattr(base, name)

    @classmethod
    def wrap(cls, module: nn.Module, config: Any = None, policy: Any = None) -> RoutedAttention:
        """Wrap one supported attention module (``policy`` lets several layers share one)."""
        return wrap_module(module, config or CondCompConfig(), policy)

    def weights(self) -> AttentionWeights:
        return self.adapter.weights(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.condcomp_disabled:  # condcomp.disabled(model): the original module, exactly
            return self.sync_base()(*args, **kwargs)
        return self.adapter.forward(self, *args, **kwargs)

    def sync_base(self) -> nn.Module:
        """The original module with every parameter, buffer and child this wrapper holds now (a cast or a move
        replaces buffers, PEFT replaces projections: the original must see them); returns it."""
        base = self.base
        for table, mine in ((base._parameters, self._parameters), (base._buffers, self._buffers),
                            (base._modules, self._modules)):
            for name in table:
                if name in mine and table[name] is not mine[name]:
                    table[name] = mine[name]  # type: ignore[assignment]
        base.train(self.training)
        return base

    def held_plan(self, cache: Any) -> tuple[HeadPlan, KVSelection | None] | None:
        """The plan of the request whose KV cache is ``cache``, as stored in it by this layer (decided at the
        request's first call), and its KV selection (None where the cache keeps every key/value head); None when
        the cache holds no plan for this layer. :func:`condcomp.request_plans` reads every layer's."""
        held = self.adapter.held_record(cache) if cache is not None and hasattr(self.adapter, "held_record") else None
        return None if held is None else (held.plan, held.selection)

    def attend(self, inputs: AttentionInputs, plan: HeadPlan | None = None, condition: Tensor | None = None) -> Tensor:
        """Policy -> router -> executor on canonical inputs; returns ``(B, T, D)``.

        ``plan``: a plan decided before (a decoder request's plan, read from its KV cache): the executor computes it
        and nothing is routed. ``condition (B, Dc)``: a per-example conditioning vector for a policy that reads one
        (``reads_condition``).
        """
        self._validate(inputs)
        weights = self.weights()
        if plan is None:
            plan = self.route(inputs.x, inputs.mask, weights, inputs.num_keys, condition)
        executor = resolve_executor(self.executor, weights, inputs, plan, notices=self.notices)
        if self.last is not None:  # which executor (and gathered strategy) ran: HeadUsage reports it
            self.last = replace(self.last, executor=getattr(executor, "name", None),
                                strategy=getattr(executor, "strategy", None))
        return executor(weights, inputs, plan)  # type: ignore[no-any-return]

    def attend_parts(self, x: Tensor, plan: HeadPlan | None = None, *, key: Tensor | None = None,
                     value: Tensor | None = None, mask: Tensor | None = None, key_mask: Tensor | None = None,
                     attn_bias: Tensor | None = None, rotary: tuple[Tensor, Tensor] | None = None,
                     key_states: Tensor | None = None, value_states: Tensor | None = None) -> Tensor:
        """:meth:`attend` on one call's parts (the fields of :class:`~condcomp.AttentionInputs`), with the layer's
        attention dropout in training and none in evaluation: the step every adapter's ``forward`` ends with."""
        inputs = AttentionInputs(x=x, key=key, value=value, mask=mask, key_mask=key_mask, attn_bias=attn_bias,
                                 rotary=rotary, key_states=key_states, value_states=value_states,
                                 dropout_p=self.layout.dropout_p if self.training else 0.0)
        return self.attend(inputs, plan)  # (B, T, D)

    def _validate(self, inputs: AttentionInputs) -> None:
        x, L = inputs.x, self.layout
        if x.dim() != 3:
            raise ValueError(f"{type(self.base).__name__}: expected input of shape (B, T, D={L.d_model}), "
                             f"got {tuple(x.shape)}")
        if x.shape[-1] != L.d_model:
            raise ValueError(f"{type(self.base).__name__}: input width {x.shape[-1]} does not match the "
                             f"layer's d_model={L.d_model}")
        if not x.is_floating_point():
            raise TypeError(f"attention input must be floating point, got {x.dtype}")
        B, T = x.shape[:2]
        if inputs.mask is not None and tuple(inputs.mask.shape) != (B, T):
            raise ValueError(f"padding mask must be (B, T) = {(B, T)}, got {tuple(inputs.mask.shape)}")
        S = inputs.num_keys
        for name, m in (("padding mask", inputs.mask), ("key padding mask", inputs.key_mask)):
            if m is not None and m.is_floating_point():
                raise TypeError(f"the {name} must be bool (True = real token), got {m.dtype}; an additive float "
                                "mask goes in attn_bias")
        if inputs.key_mask is not None and tuple(inputs.key_mask.shape) != (B, S):
            raise ValueError(f"key padding mask must be (B, S) = {(B, S)}, got {tuple(inputs.key_mask.shape)}")
        _check_context(inputs, L, B, T, S)
        if self.check_inputs and not bool(torch.isfinite(x).all()):
            bad = (~torch.isfinite(x)).flatten(1).any(1).nonzero().flatten().tolist()
            raise ValueError(f"non-finite values (NaN or inf) in the attention input of examples {bad}; "
                             "check_inputs=True rejects them (set it False to let them propagate)")

    def extra_repr(self) -> str:
        return f"base={type(self.base).__name__}, executor={self.executor!r}"


def _check_context(inputs: AttentionInputs, L: HeadLayout, B: int, T: int, S: int) -> None:
    """Keys, values, bias and rotary tables of the wrong shape fail here, named, not deep inside a matmul."""
    if inputs.key_states is not None or inputs.value_states is not None:
        want_kv: tuple[int, ...] = (B, L.num_kv_heads, S, L.head_dim)
        for name, t in (("key_states", inputs.key_states), ("value_states", inputs.value_states)):
            if t is None or tuple(t.shape) != want_kv:
                got = None if t is None else tuple(t.shape)
                raise ValueError(f"{name} must be (B, Hkv, S, Dh) = {want_kv} (both or neither), got {got}")
    else:
        Dk, Dv = L.kdim or L.d_model, L.vdim or L.kdim or L.d_model
        key, value = inputs.key_input, inputs.value_input
        if key.dim() != 3 or key.shape[0] != B or key.shape[2] != Dk:
            raise ValueError(f"key input must be (B={B}, S, Dk={Dk}), got {tuple(key.shape)}")
        if tuple(value.shape) != (B, S, Dv):
            raise ValueError(f"value input must be (B, S, Dv) = {(B, S, Dv)} (as many tokens as the keys), "
                             f"got {tuple(value.shape)}")
    want = (B, L.num_heads, T, S)
    bias = inputs.attn_bias
    if bias is not None:
        try:
            fits = bias.dim() <= 4 and torch.broadcast_shapes(bias.shape, want) == want
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attn_bias {tuple(bias.shape)} does not broadcast to (B, H, T, S) = {want}")
    for t in inputs.rotary or ():
        if t.dim() != 3 or t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (T, L.head_dim):
            raise ValueError(f"rotary cos/sin must be (B, T, Dh) = {(B, T, L.head_dim)}, got {tuple(t.shape)}")


def layer_facts(adapter: Any) -> dict[str, int]:
    """The layer facts a component constructor may ask for (``registry.LAYER_FACTS``)."""
    L = adapter.layout
    return {"d_model": L.d_model, "num_heads": L.num_heads, "num_kv_heads": L.num_kv_heads, "head_dim": L.head_dim}


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (cpu without any)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def check_projections(adapter: Any, module: nn.Module, name: str) -> None:
    """Read the module's projections once, so one condcomp cannot read exactly is refused now, by name."""
    try:
        with torch.no_grad():
            adapter.weights(module)
    except ProjectionError as e:
        raise ProjectionError(f"cannot wrap {name} ({type(module).__qualname__}): {e}") from None


def read_adapter(module: nn.Module, name: str = "module") -> AttentionAdapter:
    """The adapter of one supported attention module, its projections read once. A module condcomp cannot wrap (no
    adapter matches, an option the adapter cannot honour, a projection it cannot read exactly) is refused here, by
    name: both attachments (the module swap and transformers' attention function) read their modules through it."""
    adapter_cls = find_adapter(module)
    if adapter_cls is None:
        raise TypeError(f"{name} ({type(module).__qualname__}) is not a supported attention module; "
                        f"supported: {', '.join(supported_classes())}; support another class with an "
                        "AttentionAdapter (docs/extending.md)")
    reason = adapter_cls.unsupported_reason(module)
    if reason is not None:
        raise ValueError(f"cannot wrap {name} ({type(module).__qualname__}): {reason}")
    adapter = adapter_cls(module)
    check_projections(adapter, module, name)
    return adapter


def build_routing(config: CondCompConfig, adapter: Any, device: torch.device, name: str = "module",
                  policy: Any = None) -> tuple[Any, Any]:
    """One layer's ``(policy, router)``, built from ``config`` for the adapter's layout (``policy``: one shared with
    other layers) and placed on ``device``, float32 whatever the model's dtype (RoutingHost's rule)."""
    facts = layer_facts(adapter)
    try:  # options checked against the layer (e.g. one init score per head) name the layer when they fail
        if policy is None:
            policy = POLICIES.build(config.policy[0], config.policy[1], facts)
        router = ROUTERS.build(config.router[0], config.router[1], facts)
    except (TypeError, ValueError) as e:
        raise type(e)(f"cannot wrap {name}: {e}") from None
    for component in (policy, router):
        if isinstance(component, nn.Module):
            component.to(device)
    return policy, router


def wrap_module(module: nn.Module, config: CondCompConfig, policy: Any = None, name: str = "module",
                notices: Notices | None = None) -> RoutedAttention:
    """One supported attention module -> RoutedAttention (components built from ``config``); ``notices``: the
    warnings already given, shared with the model's other layers (default: its own)."""
    adapter = read_adapter(module, name)
    policy, router = build_routing(config, adapter, module_device(module), name, policy)
    routed = RoutedAttention(module, adapter, policy, router, config.executor, config.check_inputs)
    # What built it, so saving needs no config passed back in (a copy: editing the caller's config object later
    # must not change what a save writes).
    routed.condcomp_config = copy.deepcopy(config)
    if notices is not None:
        routed.__dict__["condcomp_notices"] = notices
    return routed
