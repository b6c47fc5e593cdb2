"""What ``condcomp tune-llm`` measures: the loss on continuation tokens only, held-out perplexity per dataset,
greedy continuations compared with the dense model's, samples, and the heads the plans kept.

A sequence's first ``prompt_len`` tokens are its prompt: a per-request plan is decided from them (under
``condcomp.plan_from_prompt``), so only the tokens after the prompt are scored; every variant, dense included,
is scored on the same tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

import condcomp
from condcomp.kv.continuation import continuation_nll, continuation_outputs, prompt_plans, token_nll
from condcomp.plans import kv_groups_used

__all__ = ["agreement", "continuation_nll", "continuation_outputs", "greedy", "kept_groups", "perplexity",
           "plan_variety", "prompt_plans", "token_nll", "usage_summary"]


@torch.no_grad()
def perplexity(model: nn.Module, ids: Tensor, sources: list[str], prompt_len: int, batch_size: int,
               bar: Any = None) -> dict[str, Any]:
    """Mean continuation NLL and perplexity per dataset and overall (every continuation token weighs the same)."""
    model.eval()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    usage: list[dict[str, float | None]] = []
    kept: dict[str, list[Tensor]] = {}
    for start in range(0, ids.shape[0], batch_size):
        nll = continuation_nll(model, ids[start:start + batch_size], prompt_len).double()  # (b, T - P)
        for row, src in zip(nll, sources[start:start + batch_size]):
            sums[src] = sums.get(src, 0.0) + float(row.sum())
            counts[src] = counts.get(src, 0) + row.numel()
        usage.append(usage_summary(model))
        for name, groups in kept_groups(model).items():
            kept.setdefault(name, []).append(groups)
        if bar is not None:
            bar.update(1)
    per = {s: {"nll": sums[s] / counts[s], "ppl": math.exp(sums[s] / counts[s]), "tokens": counts[s]} for s in sums}
    total = sum(sums.values()) / sum(counts.values())
    mean_usage = {k: (sum(u[k] for u in usage) / len(usage) if all(u[k] is not None for u in usage) else None)  # type: ignore[misc]
                  for k in usage[0]}
    mean_usage["plan_variety"] = plan_variety({n: torch.cat(g) for n, g in kept.items()})
    return {"nll": total, "ppl": math.exp(total), "tokens": sum(counts.values()), "per_dataset": per,
            "usage": mean_usage}


@torch.no_grad()
def greedy(model: nn.Module, prompts: Tensor, new_tokens: int, pad_id: int) -> Tensor:
    """Greedy continuations ``(N, new_tokens)`` with the model's KV cache (``generate``); all prompts have the
    same length, so no padding. A per-request plan is decided at prefill from the prompt and held while the
    request decodes (condcomp's held plans), as a user's ``generate()`` call does."""
    model.eval()
    generate: Any = getattr(model, "generate")  # noqa: B009  (transformers' GenerationMixin)
    out = generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return out[:, prompts.shape[1]:]


def agreement(tokens: Tensor, reference: Tensor) -> dict[str, float]:
    """Position-wise token agreement and mean length of the common prefix, as fractions of the new tokens.

    >>> agreement(torch.tensor([[1, 2, 3], [1, 9, 3]]), torch.tensor([[1, 2, 3], [1, 2, 3]]))
    {'token_agreement': 0.8333333333333334, 'prefix_agreement': 0.6666666666666666}
    """
    same = tokens == reference  # (N, n)
    prefix = same.long().cumprod(-1).sum(-1).double() / same.shape[1]
    return {"token_agreement": float(same.double().mean()), "prefix_agreement": float(prefix.mean())}


def usage_summary(model: nn.Module) -> dict[str, float | None]:
    """Head usage of the last forward, averaged over layers: predicted budget, realised query-head fraction and,
    for sequence plans, the KV-group fraction (a token plan keeps every group's keys and values: 1)."""
    routed = condcomp.routed_modules(model)
    if not routed:
        return {"s_mean": None, "k_frac": 1.0, "kv_frac": 1.0}
    stats = [u for u in (m.head_usage() for m in routed.values()) if u is not None]
    s_mean = sum(u.s_mean for u in stats) / len(stats)
    k_frac = sum(u.k_frac for u in stats) / len(stats)
    kv = [_kv_fraction(m) for m in routed.values()]
    known = [f for f in kv if f is not None]
    return {"s_mean": s_mean, "k_frac": k_frac, "kv_frac": sum(known) / len(known) if known else None}


def kept_groups(model: nn.Module) -> dict[str, Tensor]:
    """Per routed layer with a sequence plan in its last forward: the KV groups each row kept, ``(B, G)`` bool."""
    kept = {name: _kept_kv_groups(module) for name, module in condcomp.routed_modules(model).items()}
    return {name: groups.cpu() for name, groups in kept.items() if groups is not None}


def plan_variety(kept: dict[str, Tensor]) -> float | None:
    """How much per-request plans vary: per layer, the fraction of requests whose kept KV groups differ from the
    layer's most common set, averaged over layers (0: every request kept the same groups, as static pruning
    does). None without sequence plans.

    >>> plan_variety({"a": torch.tensor([[1, 0], [1, 0], [0, 1], [1, 0]]).bool()})
    0.25
    """
    if not kept:
        return None
    varied = []
    for groups in kept.values():  # (N, G)
        _sets, counts = torch.unique(groups, dim=0, return_counts=True)
        varied.append(1.0 - float(counts.max()) / groups.shape[0])
    return sum(varied) / len(varied)


def _kept_kv_groups(module: nn.Module) -> Tensor | None:
    """``(B, G)`` bool: the KV groups some active head of the last forward's sequence plan reads; None without one."""
    last = getattr(module, "last", None)
    plan = last.plan if last is not None else None
    if plan is None or plan.active.dim() != 2:
        return None
    return kv_groups_used(plan.active, module.layout.num_kv_heads)  # type: ignore[union-attr,arg-type]


def _kv_fraction(module: nn.Module) -> float | None:
    if getattr(getattr(module, "condcomp_router", None), "granularity", None) == "token":
        return 1.0  # a later token may pick any head: every group is cached
    groups = _kept_kv_groups(module)
    return None if groups is None else float(groups.double().mean())
