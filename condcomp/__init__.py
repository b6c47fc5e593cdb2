"""condcomp: conditional computation over attention heads.

Heads are experts that each input (or token) may use or skip: a budget policy says how many, a router says
which, an executor computes only those. See docs/concepts.md.
"""

# integrations, policies and routers live in top-level folders mapped into the package (pyproject's package-dir);
# mypy >= 2.4 checks them as top-level packages and does not see them as condcomp's attributes
from condcomp import executors, integrations, kv, policies, routers  # type: ignore[attr-defined]  # noqa: F401
from condcomp.adapters import AttentionAdapter, register_adapter
from condcomp.api import (
    apply_,
    aux_loss,
    budget,
    disabled,
    head_usage,
    plan_from_prompt,
    remove_,
    request_plans,
    routed_modules,
    set_progress,
)
from condcomp.attention import HeadAttention
from condcomp.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_config, save_checkpoint
from condcomp.config import CondCompConfig
from condcomp.executors.auto import explain, get_executor
from condcomp.kv import KVPolicy, KVSelection, RequestPlan, select_kv
from condcomp.plans import budget_k, full_plan, plan_from_active, plan_top_k, top_k_mask
from condcomp.protocols import BudgetPolicy, Capabilities, Estimate, Executor, Router
from condcomp.registry import (
    list_executors,
    list_kv_policies,
    list_policies,
    list_routers,
    register_executor,
    register_kv_policy,
    register_policy,
    register_router,
)
from condcomp.routed import RoutedAttention
from condcomp.schedules import make_schedule
from condcomp.types import AttentionInputs, AttentionWeights, Budget, HeadLayout, HeadPlan, HeadUsage

__version__ = "0.2.0"

__all__ = [
    "AttentionAdapter", "AttentionInputs", "AttentionWeights", "Budget", "BudgetPolicy", "Capabilities",
    "CheckpointError", "Estimate", "CondCompConfig", "load_checkpoint", "read_checkpoint_config", "save_checkpoint",
    "Executor", "HeadAttention", "HeadLayout", "HeadPlan", "HeadUsage", "KVPolicy", "KVSelection", "RequestPlan",
    "RoutedAttention", "Router", "apply_", "aux_loss", "budget", "budget_k", "disabled", "explain", "full_plan",
    "get_executor", "head_usage", "list_executors", "list_kv_policies", "list_policies", "list_routers",
    "make_schedule", "plan_from_active", "plan_from_prompt", "plan_top_k", "register_adapter", "register_executor",
    "register_kv_policy", "register_policy", "register_router", "remove_", "request_plans", "routed_modules",
    "select_kv", "set_progress", "top_k_mask"
]
