"""The compared DiT variants as condcomp configurations.

- ``dense``: the plain DiT (no wrapping): every head, the baseline.
- ``moh_90`` / ``moh_75`` / ``moh_50``: MoH as in the paper's DiT variant: per-token routing with shared heads
  (a quarter of the heads, always on) plus the top-K of the routed ones so that 90 / 75 / 50 % of the heads are
  active per token, two-stage gates and the load-balance loss weighted as the released scripts do
  (``0.01 * mean over layers of E * sum_i f_i P_i``).
- ``budgetformer_cond``: a learned per-image budget (``budgetformer_cond`` policy, which reads the adaLN
  conditioning vector: timestep + class) with BudgetFormer's ``topk`` head scorer.
- ``budgetformer``: the same without the conditioning (pooled tokens only): the control for the timestep input.
- ``fixed``: the ``fixed`` policy + ``topk`` scorer at ``fraction`` (the study sets it to the nearest whole head
  count to ``budgetformer_cond``'s measured mean: fixed top-k at matched heads).
"""

from __future__ import annotations

from typing import Any

from condcomp.config import CondCompConfig

MOH_ACTIVE = {"moh_90": 0.9, "moh_75": 0.75, "moh_50": 0.5}
VARIANTS = ("dense", *MOH_ACTIVE, "budgetformer_cond", "budgetformer", "fixed")
SHARED_FRACTION = 0.25  # MoH's shared heads, as a fraction of H (the ViT study's default)
# The learned budget's interval: wide enough for the budget to follow the noise level, centred below 1 so the
# learned arm and its matched fixed arm both skip heads.
BUDGET_OPTIONS: dict[str, Any] = {"s_min": 0.25, "s_max": 0.9}


def moh_heads(variant: str, num_heads: int) -> tuple[int, int]:
    """``(shared_heads, top_k)`` of a MoH variant; refuses head counts where the fraction is not whole."""
    active = MOH_ACTIVE[variant] * num_heads
    shared = round(SHARED_FRACTION * num_heads)
    if abs(active - round(active)) > 1e-9 or shared < 1 or round(active) <= shared:
        raise ValueError(f"{variant}: {MOH_ACTIVE[variant]:.0%} of {num_heads} heads is not a whole head count above "
                         f"the {shared} shared heads; use a head count like 20")
    return shared, round(active) - shared


def variant_config(variant: str, num_heads: int, num_layers: int, d_model: int, executor: str = "auto",
                   fraction: float | None = None, options: dict[str, Any] | None = None) -> CondCompConfig | None:
    """The :class:`CondCompConfig` of ``variant`` (None for ``dense``). ``fraction``: the ``fixed`` variant's
    share of heads (required for it); ``options`` override the budget policies' options."""
    if variant not in VARIANTS:
        raise KeyError(f"unknown DiT variant {variant!r}; valid: {list(VARIANTS)}")
    if variant == "dense":
        return None
    if variant in MOH_ACTIVE:
        shared, top_k = moh_heads(variant, num_heads)
        router = ("moh", {"shared_heads": shared, "top_k": top_k, "balance": "released",
                          "balance_layers": num_layers})
        return CondCompConfig(policy="full", router=router, executor=executor)
    if variant == "fixed":
        if fraction is None:
            raise ValueError("the fixed variant needs its fraction of heads (the matched budget)")
        return CondCompConfig(policy=("fixed", {"fraction": fraction}), router="topk", executor=executor)
    opts = {**BUDGET_OPTIONS, **(options or {})}
    if variant == "budgetformer_cond":
        opts.setdefault("condition_dim", d_model)
    return CondCompConfig(policy=(variant, opts), router="topk", executor=executor)
