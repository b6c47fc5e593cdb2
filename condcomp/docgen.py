"""Writes docs/api.md from the docstrings: every public name, the integration API and every registered component
with its options, in the order a user looks for them.

    python -m condcomp.docgen            # rewrite docs/api.md
    python -m condcomp.docgen --check    # exit 1 if docs/api.md is stale (a test runs this check)
"""

from __future__ import annotations

import argparse
import inspect
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import condcomp
from condcomp.executors.gathered import CPU, CUDA, STRATEGIES
from condcomp.registry import EXECUTORS, LAYER_FACTS, POLICIES, ROUTERS, Registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _doc(obj: Any) -> str:
    return inspect.getdoc(obj) or "(no docstring)"


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _options(cls: Any) -> list[str]:
    """``name=default`` for every constructor option a config may set (layer facts are filled in by apply_)."""
    out = []
    for p in inspect.signature(cls).parameters.values():
        if p.name in LAYER_FACTS or p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append(f"`{p.name}`" + ("" if p.default is p.empty else f" = `{p.default!r}`"))
    return out


# Public names grouped by what a user looks for, in that order; names of ``condcomp.__all__`` not listed here
# land in "Other names", so none is ever left out.
SECTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Wrap a model and train it", "Configure, wrap, train, inspect, undo.",
     ("CondCompConfig", "apply_", "remove_", "disabled", "aux_loss", "set_progress", "head_usage", "HeadUsage",
      "routed_modules", "plan_from_prompt", "budget", "request_plans", "RequestPlan", "explain",
      "RoutedAttention")),
    ("Save and load", "Whole-model training checkpoints of any model (transformers models: see Integrations).",
     ("save_checkpoint", "load_checkpoint", "read_checkpoint_config", "CheckpointError")),
    ("List and extend the components", "Registries and the protocols a new component implements "
     "(docs/extending.md).",
     ("list_policies", "list_routers", "list_executors", "register_policy", "register_router", "register_executor",
      "register_adapter", "BudgetPolicy", "Router", "Executor", "AttentionAdapter", "Capabilities", "Estimate",
      "get_executor", "make_schedule")),
    ("Data types and plan helpers", "What flows between the components.",
     ("HeadPlan", "Budget", "HeadLayout", "AttentionInputs", "AttentionWeights", "KVSelection", "HeadAttention",
      "budget_k", "top_k_mask", "plan_top_k", "plan_from_active", "full_plan", "select_kv")),
)

# Integration names: (module, attribute); each module imports its library (transformers) on first use.
INTEGRATIONS: tuple[tuple[str, str], ...] = (
    ("condcomp.integrations.hf", "CondCompCallback"),
    ("condcomp.integrations.hf.checkpoint", "save_pretrained"),
    ("condcomp.integrations.hf.checkpoint", "from_pretrained"),
    ("condcomp.integrations.hf.checkpoint", "save_condcomp"),
    ("condcomp.integrations.hf.checkpoint", "load_condcomp"),
    ("condcomp.experiments.llm.smollm2", "load_smollm2"),
    ("condcomp.experiments.llm.model_cache", "clear_model_cache"),
    ("condcomp.integrations.hf", "register_transformers_attention"),
    ("condcomp.integrations.hf", "supported_transformers_classes"),
    ("condcomp.integrations.hf.interface", "apply_interface_"),
    ("condcomp.integrations.hf.interface", "remove_interface_"),
    ("condcomp.kv", "adopt"),
)


def _entry(title: str, obj: Any) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "function"
    return [f"### `{title}`", "", f"{kind} `{title.rsplit('.', 1)[-1]}{_signature(obj)}`", "", _doc(obj), ""]


def _public_names() -> list[str]:
    lines: list[str] = []
    placed: set[str] = set()
    for title, intro, names in SECTIONS:
        lines += [f"## {title}", "", intro, ""]
        for name in names:
            if name in condcomp.__all__:
                lines += _entry(name, getattr(condcomp, name))
                placed.add(name)
        if title == "Wrap a model and train it":
            lines += _entry("RoutedAttention.held_plan", condcomp.RoutedAttention.held_plan)
    rest = sorted(set(condcomp.__all__) - placed, key=str.lower)
    if rest:
        lines += ["## Other names", ""]
        for name in rest:
            lines += _entry(name, getattr(condcomp, name))
    return lines


def _integrations() -> list[str]:
    import importlib

    lines = ["## Integrations (transformers, SmolLM2)", "",
             "`import condcomp` imports no third-party model library; each of these modules imports transformers "
             "when first used (`pip install -e \".[hf]\"`; SmolLM2 needs `.[llm]`). Each heading names the module to "
             "import (`from condcomp.integrations.hf.checkpoint import from_pretrained`).", ""]
    for module, name in INTEGRATIONS:
        obj = getattr(importlib.import_module(module), name)
        lines += _entry(f"{module}.{name}", obj)
    return lines


def _registry(registry: Registry[Any], title: str, label: str = "Options") -> list[str]:
    lines = [f"## Registered {title}", ""]
    for key in registry.names():
        cls = registry.get(key)
        options = _options(cls)
        lines += [f"### `{key}` ({cls.__module__}.{cls.__qualname__})", "",
                  f"{label}: " + (", ".join(options) if options else "none"), "", _doc(cls), ""]
    return lines


def _gathered() -> list[str]:
    lines = ["## The gathered executor's strategies and tuning", "",
             "Strategies are tried in this order; the first that can run a call runs it (`condcomp.explain` says why "
             "the others did not).", "", "| granularity | strategy | implemented by |", "|---|---|---|"]
    for granularity, strategies in STRATEGIES.items():
        lines += [f"| {granularity} | `{r.name}` | `{type(r).__module__}.{type(r).__qualname__}` |" for r in strategies]
    lines += ["", "`sequence.triton` runs Triton kernels (the ops of `condcomp.executors.gathered.pairs`) on CUDA. "
              "triton comes with torch's Linux CUDA wheels; elsewhere install the `gpu` extra: "
              "`pip install -e \".[gpu]\"`. Without it that strategy says so and the others run."]
    lines += ["", "`GatheredTuning` fields and their values on CPU (measured) and CUDA (not measured on a GPU yet):",
              "", "| field | CPU | CUDA |", "|---|---|---|"]
    assert is_dataclass(CPU)
    lines += [f"| `{f.name}` | `{getattr(CPU, f.name)!r}` | `{getattr(CUDA, f.name)!r}` |" for f in fields(CPU)]
    return [*lines, ""]


def render() -> str:
    lines = ["# API reference", "",
             "Generated by `python -m condcomp.docgen` from the docstrings; do not edit by hand (a test fails when "
             "it is stale).", ""]
    public = _public_names()
    first = public.index("## Save and load")
    lines += ["Contents: wrap a model and train it; the options of every policy, router and executor; "
              "integrations (transformers' Trainer, save/load, SmolLM2); save and load; extending; data types.", ""]
    lines += public[:first]
    lines += _registry(POLICIES, "budget policies (`CondCompConfig(policy=...)`)")
    lines += _registry(ROUTERS, "routers (`CondCompConfig(router=...)`)")
    lines += _registry(EXECUTORS, "executors (`CondCompConfig(executor=...)`, or `\"auto\"`)",
                       "Constructor options (a config names an executor by key only)")
    lines += _integrations()
    lines += public[first:]
    lines += _gathered()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from the docstrings")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m condcomp.docgen", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
