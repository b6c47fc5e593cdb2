"""The trip of one decode step through condcomp's files, traced with ``sys.setprofile`` (DESIGN: the decode step
reads one way, adapter -> base decoder sequence -> executor -> KV policy -> cache layer).

Every call into a project file inside a wrapped layer's call (``RoutedAttention.forward`` down to its return) is
an edge from the nearest project frame below it on the stack (transformers' and torch's frames in between are
skipped) to the callee's file. An edge to a file of a higher layer (:func:`rank`) climbs back up; a file entered
from another file more than once in one layer call is re-entered. Run it for the numbers:
``.venv/bin/python tests/integrations/hf/decode_trip.py`` (from the repository root).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Shared helpers any layer may call (shapes, masks, rotary, SDPA, the registries, reading a module's canonical
# weights): calling one is never a climb, one calling up is.
HELPERS = ("condcomp/types.py", "condcomp/rotary.py", "condcomp/masks.py", "condcomp/dense.py",
           "condcomp/plans.py", "condcomp/notices.py", "condcomp/kv/kernels/", "condcomp/kv/static.py",
           "condcomp/registry.py", "condcomp/protocols.py", "condcomp/attention.py", "condcomp/projections.py",
           "condcomp/options.py", "condcomp/versions.py")


def rank(path: str) -> int:
    """A file's layer, top (0) to bottom: the wrapped module, the transformers adapter, the base decoder
    sequence, the executors, the KV policies, the cache layer; the shared helpers below them all."""
    if path.startswith(HELPERS):
        return 6
    if path in ("condcomp/routed.py", "condcomp/host.py"):
        return 0
    if path.startswith("integrations/"):
        return 1
    if path == "condcomp/kv/decoder.py":
        return 2
    if path.startswith("condcomp/executors/"):
        return 3
    if path == "condcomp/kv/layer.py":
        return 5
    if path.startswith("condcomp/kv/"):
        return 4
    return 0  # any other core file counts as the top: reaching it from below is a climb


@dataclass
class LayerTrip:
    """One wrapped layer's call: its cross-file call edges ``(caller file, callee file, callee function)``."""

    edges: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def files(self) -> set[str]:
        return {"condcomp/routed.py"} | {b for _, b, _ in self.edges}

    @property
    def climbs(self) -> list[tuple[str, str, str]]:
        return [e for e in self.edges if rank(e[1]) < rank(e[0])]

    def reentries(self, helpers: bool = False) -> dict[str, int]:
        """Files entered from another file more than once: ``{file: extra entries}`` (helpers only if asked)."""
        entered = Counter(b for _, b, _ in self.edges if helpers or rank(b) != 6)
        return {f: n - 1 for f, n in entered.items() if n > 1}


def _project(path: str) -> str | None:
    if not path.startswith(ROOT) or "/.venv/" in path or "/site-packages/" in path:
        return None
    return os.path.relpath(path, ROOT)


def trace(call: Any) -> tuple[list[LayerTrip], Any]:
    """``call()`` traced: one :class:`LayerTrip` per wrapped layer call it makes, and its result."""
    trips: list[LayerTrip] = []
    depth = [0]  # nesting of RoutedAttention.forward (0: outside a layer's call)

    def below(frame: FrameType) -> str | None:
        f = frame.f_back
        while f is not None:
            rel = _project(f.f_code.co_filename)
            if rel is not None:
                return rel
            f = f.f_back
        return None

    def prof(frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        rel = _project(frame.f_code.co_filename)
        if rel is None:
            return
        entry = rel == "condcomp/routed.py" and frame.f_code.co_name == "forward"
        if event == "return":
            depth[0] -= entry
            return
        if entry:
            depth[0] += 1
            if depth[0] == 1:
                trips.append(LayerTrip())
                return
        if depth[0] == 0:
            return
        caller = below(frame)
        if caller is not None and caller != rel:
            trips[-1].edges.append((caller, rel, frame.f_code.co_name))

    sys.setprofile(prof)
    try:
        out = call()
    finally:
        sys.setprofile(None)
    return trips, out


def tiny_llama(variant: str = "keep_0.25") -> Any:
    """The trip's model: the bench's tiny Llama as ``variant`` (``keep_0.25``: keeping 1/4 of its KV groups, the
    others dropped; ``stream_0.25``: the others in a streaming window; ``snapkv_0.25``: the others under
    ``kv="snapkv"``, the prompt's tokens each group's heads attend most)."""
    import condcomp
    from condcomp.bench.decode import load_model, variants

    if variant.startswith("snapkv_"):
        model = load_model("tiny-llama")
        torch.manual_seed(0)  # the router's initial weights
        config = condcomp.CondCompConfig(policy=("fixed", {"fraction": float(variant.removeprefix("snapkv_"))}),
                                         router=("topk", {"kv_groups": True}), executor="auto", kv="snapkv")
        condcomp.apply_(model, config)
        return model.eval()
    return variants(load_model("tiny-llama"), "tiny-llama", [variant])[variant]


def decode_step_trips(model: Any, static: bool = False) -> list[LayerTrip]:
    """The trips of one decode step (each layer's call) after a prefill of 2 x 16 tokens, on a ``DynamicCache``
    or a ``StaticCache``."""
    import transformers

    torch.manual_seed(0)
    ids = torch.randint(0, 2000, (2, 16))
    cache: Any = (transformers.StaticCache(config=model.config, max_cache_len=32) if static
                  else transformers.DynamicCache(config=model.config))
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        position = torch.full((2, 1), 16)
        trips, _ = trace(lambda: model(input_ids=nxt, position_ids=position, past_key_values=cache, use_cache=True))
    return trips


def family_step_trips(arch: str) -> list[LayerTrip]:
    """The trips of one decode step of the tiny ``arch`` model of ``arch_models`` (a decoder: ``gpt2``, ``qwen3``,
    ``mixtral``, ``gemma``) keeping half its heads (KV groups where it has them), after a prefill of 2 x 8 tokens."""
    import transformers
    from arch_models import build
    from decode_helpers import wrap

    model = wrap(build(arch).float(), 0.5)
    torch.manual_seed(0)
    ids = torch.randint(1, 90, (2, 8))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        trips, _ = trace(lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True))
    return trips


def report(trips: list[LayerTrip]) -> str:
    """Per-step totals and the first layer's edges."""
    files = set().union(*(t.files for t in trips))
    lines = [f"layer calls {len(trips)}; files {len(files)}; transitions {sum(len(t.edges) for t in trips)}; "
             f"climbs {sum(len(t.climbs) for t in trips)}; re-entries (layered files) "
             f"{sum(sum(t.reentries().values()) for t in trips)}; (all files) "
             f"{sum(sum(t.reentries(helpers=True).values()) for t in trips)}"]
    first = trips[0]
    lines.append(f"first layer: files {len(first.files)}, transitions {len(first.edges)}, climbs {len(first.climbs)}, "
                 f"re-entries {first.reentries()}")
    lines += [f"  {'UP ' if rank(b) < rank(a) else '   '}{a} -> {b}:{fn}" for a, b, fn in first.edges]
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for variant in sys.argv[1:] or ["keep_0.25"]:
        model = tiny_llama(variant)
        for static in (False, True):
            print(variant, "StaticCache" if static else "DynamicCache")
            print(report(decode_step_trips(model, static)))
