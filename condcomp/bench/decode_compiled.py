"""``condcomp bench decode --compile``: every variant decodes on a static cache, eager and under ``torch.compile``.

transformers' fast decode on a GPU is a static cache with a compiled forward (``generate(...,
cache_implementation="static", compile_config=...)``; ``mode="reduce-overhead"``: CUDA graphs). With
``--compile`` each variant (``dense``: transformers' own static cache; ``full`` / ``keep_<f>``: condcomp's compact
cache in it) prefills eagerly into a ``StaticCache`` sized for the prompt and the new tokens, then decodes twice,
interleaved step by step with the others: eagerly (the variant's own name) and through
``torch.compile(model, fullgraph=True)`` (``<name>+compiled``). Each compiled step is paired with the compiled dense
step of the same index, each eager one with the eager dense one. Recorded besides :mod:`condcomp.bench.decode`'s
fields: ``compiled``, ``compiles`` (graphs dynamo compiled for the variant over the whole run: 1 is the warm-up,
more are recompilations), ``graph_skips`` (of those, the graphs inductor compiled without the CUDA graphs
``reduce-overhead`` asks for: 0 on CUDA means every compiled step replays a graph), ``tokens_equal_eager`` (a
compiled variant's greedy tokens against its own eager ones) and ``decode_ratio_faster_dense`` (every step paired
with the step of the same index of ``faster_dense``, the faster of eager and compiled dense by median: what a user
who picks the faster way to decode dense would compare against).

On a CPU compiling is the capture check (no graph break, no recompilation), not a speed path: transformers' own
compiled static decode is slower than eager there (docs/llm-serving.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

COMPILED = "+compiled"  # suffix of a variant's compiled run


def compile_mode(mode: str | None, device: torch.device) -> str | None:
    """``--compile-mode``: as given, or ``reduce-overhead`` (CUDA graphs, transformers' default) on CUDA and torch's
    default elsewhere."""
    if mode is not None:
        return None if mode == "default" else mode
    return "reduce-overhead" if device.type == "cuda" else None


def compiled_steps(models: dict[str, nn.Module], backend: str, mode: str | None) -> dict[str, Callable[..., Any]]:
    """``{"<name>+compiled": torch.compile(model, fullgraph=True)}`` for every variant (the decode steps' forward;
    the prefill stays eager, as generate() runs it). Dynamo's caches are reset first: ``compiles`` counts this
    run's graphs, and a graph an earlier run in the process compiled (another ``run``, a test) was reused, counted 0."""
    torch._dynamo.reset()
    limit = max(8, 4 * len(models))  # one cache entry per model of the same forward code: no recompile-limit hit
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, limit)
    options: dict[str, Any] = {"fullgraph": True, "backend": backend}
    if mode is not None:
        options["mode"] = mode
    return {name + COMPILED: torch.compile(model, **options) for name, model in models.items()}


def static_cache(model: nn.Module, max_len: int) -> Any:
    """A transformers ``StaticCache`` for ``model`` (its layers allocated at the prefill: condcomp's compact ones
    with the kept groups only)."""
    from transformers import StaticCache

    return StaticCache(config=getattr(model, "config"), max_cache_len=max_len)  # noqa: B009


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (read before and after a call: its compilations)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def cudagraph_skips() -> int:
    """Graphs inductor compiled without CUDA graphs in this process so far (``mode="reduce-overhead"`` asked for
    them; a mutated input that is not a static address, a CPU tensor, ... makes it skip them, silently unless
    ``TORCH_LOGS=cudagraphs``): read before and after a call, as :func:`graphs_compiled`."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def baseline(name: str) -> str:
    """The dense run a variant's steps are paired with: compiled with compiled, eager with eager."""
    return "dense" + COMPILED if name.endswith(COMPILED) else "dense"


def faster_dense(runs: dict[str, list[dict[str, Any]]]) -> str:
    """``dense`` or ``dense+compiled``, whichever has the smaller median decode step over every repetition."""
    names = [n for n in ("dense", "dense" + COMPILED) if any(r["step_s"] for r in runs.get(n, ()))]
    if not names:  # a run stopped before dense decoded a step: nothing is paired with it
        return "dense"
    return min(names, key=lambda n: statistics.median(s for r in runs[n] for s in r["step_s"]))


__all__ = ["COMPILED", "baseline", "compile_mode", "compiled_steps", "cudagraph_skips", "faster_dense",
           "graphs_compiled", "static_cache"]
