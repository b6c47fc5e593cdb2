"""The compared methods as condcomp configurations, and inference-time swaps of a trained model's components.

- ``standard``: ``full`` policy (every head, gate 1) with the ``random`` router, which at k = H selects every
  head: exactly the dense Transformer.
- ``budgetformer``: learned per-example budget (``budgetformer`` policy) + ``topk`` head scorer.
- ``fixed``: static fraction ``fraction`` (fixed top-k) + ``topk`` scorer, trained that way.
- ``moh``: ``full`` policy + ``moh`` router (shared heads + per-token top-k of the routed heads), load balance
  weighted as the released MoH scripts do (``balance="released"``: 0.01 * mean over layers of E * sum f_i P_i).
- ``random``: static fraction, heads drawn at random (a control).
- ``fixed_layers``: a fixed mean head count per layer (``heads``: layer name -> mean, fractional means rounded
  per example, :class:`.layer_budget.LayerMeanPolicy`), heads chosen by the ``topk`` scorer
  (``routing="learned"``) or at random (``routing="random"``); installed by ``train.build_model``.
  ``router_options`` (``fixed`` and ``fixed_layers`` with learned routing, as ``budgetformer``): the ``topk``
  scorer's schedule (temperature, noise, mask temperature), so that a fixed arm can train with the same router
  as the BudgetFormer arm it is compared with and the two differ only in the budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from condcomp.api import routed_modules
from condcomp.config import CondCompConfig
from condcomp.experiments.classification.layer_budget import ConstantBudgetPolicy
from condcomp.experiments.classification.user_components import is_spec, resolve
from condcomp.policies.fixed import FixedPolicy
from condcomp.policies.full import FullPolicy
from condcomp.routers.random import RandomRouter

METHODS = ("standard", "budgetformer", "fixed", "moh", "random", "fixed_layers")

DEFAULTS: dict[str, dict[str, Any]] = {
    "standard": {},
    "budgetformer": {"s_min": 0.1, "s_max": 0.9},
    "fixed": {"fraction": 0.5},
    "moh": {"shared_frac": 0.25, "routed_frac": 0.25, "balance": "released"},
    "random": {"fraction": 0.5},
    "fixed_layers": {"heads": {}, "routing": "learned"},
}


def method_config(method: str, num_heads: int, options: dict[str, Any] | None = None,
                  executor: str = "auto", num_layers: int | None = None) -> CondCompConfig:
    """The :class:`CondCompConfig` of a method; ``options`` override its defaults (policy/router kwargs).

    ``moh`` takes ``shared_frac``/``routed_frac`` (fractions of H, at least one head each) or explicit
    ``shared_heads``/``top_k``; other options go to the router. ``policy``/``router`` keys override the specs.
    ``num_layers``: the routed layers of the model, which ``balance="released"`` averages over. A
    ``policy``/``router`` given as ``module:Class`` (a user's component) is imported and registered first.
    """
    if method not in METHODS:
        raise KeyError(f"unknown method {method!r}; valid: {list(METHODS)}")
    opts = {**DEFAULTS[method], **(options or {})}
    policy_spec = _user_spec("policy", opts.pop("policy", None))
    router_spec = _user_spec("router", opts.pop("router", None))
    spec_name = policy_spec if isinstance(policy_spec, str) or policy_spec is None else policy_spec[0]
    if spec_name == "budgetformer_signed":  # a study variant, registered only when a run asks for it
        from condcomp.experiments.classification.signed_budget import register

        register()
    H = num_heads
    policy: Any
    router: Any
    if method == "standard":
        policy, router = "full", "random"
    elif method == "budgetformer":
        router_kw = opts.pop("router_options", {})
        policy, router = ("budgetformer", opts), ("topk", router_kw)
    elif method == "fixed":
        router_kw = opts.pop("router_options", {})
        policy, router = ("fixed", {"fraction": opts.pop("fraction"), **opts}), ("topk", router_kw)
    elif method == "random":
        policy, router = ("fixed", {"fraction": opts.pop("fraction")}), "random"
    elif method == "fixed_layers":
        heads, routing = opts.pop("heads"), opts.pop("routing")
        router_kw = opts.pop("router_options", {})
        if not heads:
            raise ValueError("fixed_layers needs the per-layer mean head counts (option heads: {layer: mean})")
        if routing not in ("learned", "random"):
            raise ValueError(f"fixed_layers: routing must be 'learned' or 'random', got {routing!r}")
        if router_kw and routing == "random":
            raise ValueError("fixed_layers: router_options set the topk scorer's schedule; routing='random' has "
                             "no scorer to take them (drop router_options, or use routing='learned')")
        # the fixed policy is a placeholder: build_model replaces it layer by layer with the per-layer means
        policy, router = ("fixed", {"fraction": 0.5}), (("topk", router_kw) if routing == "learned" else "random")
    else:
        shared = opts.pop("shared_heads", None) or max(1, round(opts.pop("shared_frac") * H))
        top_k = opts.pop("top_k", None) or max(1, round(opts.pop("routed_frac") * H))
        opts.pop("shared_frac", None), opts.pop("routed_frac", None)
        if shared + top_k > H:
            raise ValueError(f"moh: shared_heads={shared} + top_k={top_k} exceed the {H} heads")
        if opts.get("balance") == "released" and opts.get("balance_layers") is None:
            if num_layers is None:
                raise ValueError("moh with balance='released' needs the model's layer count (num_layers)")
            opts["balance_layers"] = num_layers
        policy, router = "full", ("moh", {"shared_heads": shared, "top_k": top_k, **opts})
    return CondCompConfig(policy=policy_spec or policy, router=router_spec or router, executor=executor)


def _user_spec(role: str, spec: Any) -> Any:
    """``spec`` (a name, or ``[name, options]``) with a ``module:Class`` name imported, registered, replaced by
    its registry key (:mod:`.user_components`); anything else as it is."""
    name, options = (spec[0], dict(spec[1])) if isinstance(spec, (list, tuple)) else (spec, None)
    if not is_spec(name):
        return spec
    key = resolve(role, name)
    return key if options is None else (key, options)


@contextmanager
def swapped(model: nn.Module, policy: str | None = None, fraction: float = 0.5,
            router: str | None = None, budgets: dict[str, list[float]] | None = None) -> Iterator[nn.Module]:
    """Temporarily replace every layer's policy (``"fixed"`` at ``fraction``, ``"full"``, or ``"constant"``:
    layer name -> ``[k, s]`` in ``budgets``) and/or router (``"random"``) of a trained model: the
    inference-time controls of the ablation."""
    saved = {}
    for name, r in routed_modules(model).items():
        saved[name] = (r.condcomp_policy, r.condcomp_router)
        H = r.layout.num_heads
        if policy == "constant":
            if not budgets or name not in budgets:
                raise ValueError(f"swapped: policy 'constant' needs budgets[{name!r}] = [k, s]")
            r.condcomp_policy = ConstantBudgetPolicy(H, int(budgets[name][0]), float(budgets[name][1]))
        elif policy == "fixed":
            r.condcomp_policy = FixedPolicy(num_heads=H, fraction=fraction)
        elif policy == "full":
            r.condcomp_policy = FullPolicy(num_heads=H)
        elif policy is not None:
            raise ValueError(f"swapped: policy must be 'fixed', 'full' or 'constant', got {policy!r}")
        if router == "random":
            r.condcomp_router = RandomRouter(num_heads=H)
        elif router is not None:
            raise ValueError(f"swapped: router must be 'random', got {router!r}")
    try:
        yield model
    finally:
        for name, r in routed_modules(model).items():
            r.condcomp_policy, r.condcomp_router = saved[name]
