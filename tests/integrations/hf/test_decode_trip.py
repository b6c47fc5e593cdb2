"""A decode step reads one way (DESIGN, v0.5): adapter -> base decoder sequence -> executor -> KV policy -> cache
layer, traced call by call with ``sys.setprofile`` (:mod:`decode_trip`) on the bench's tiny Llama keeping 1/4 of
its KV groups, one decode step of 2 requests after a 16-token prefill (4 layers).

Per step, before (main at 46b179a) and after this layout, ``DynamicCache`` / ``StaticCache``:

- cross-file calls: 256 / 256 -> 136 / 152;
- calls climbing back up a layer: 48 / 48 (``routed.__getattr__`` for each projection, ``layout`` / ``weights`` /
  ``notices`` read back from the wrapped module, ``kv/`` and ``internals`` calling ``PlanLayer``'s attribute
  fallback) -> 0 / 0;
- files entered again from another file (helpers left out): 136 / 120 -> 24 / 24, 6 per layer: the executor
  file (``resolve_executor``'s ``supports`` and ``prepare``, the run, its usage record) and the KV selection's
  data properties (``rows``, ``slots``) read by the adapter, the sequence and the executor.

Run ``python tests/integrations/hf/decode_trip.py`` for the edges.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from decode_trip import decode_step_trips, rank, tiny_llama_keep_quarter  # noqa: E402

# what may still be entered twice in one layer's call, and how often (see the module docstring)
REENTRY_BOUND = {"condcomp/executors/cached.py": 3, "condcomp/kv/selection.py": 3}


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama_keep_quarter()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_decode_step_goes_down_one_way(model: Any, static: bool) -> None:
    trips = decode_step_trips(model, static)
    assert len(trips) == model.config.num_hidden_layers  # one traced call per wrapped layer
    for i, trip in enumerate(trips):
        assert trip.climbs == [], f"layer {i}: calls climbing back up: {trip.climbs}"
        down = [(a, b) for a, b, _ in trip.edges if b == "condcomp/kv/decoder.py"]
        assert down == [("integrations/hf/decode.py", "condcomp/kv/decoder.py")], (
            f"layer {i}: the adapter should hand the call to the base decoder sequence once, got {down}")
        writes = [(a, fn) for a, b, fn in trip.edges if b == "condcomp/kv/layer.py"]
        assert writes == [("condcomp/executors/cached.py", "store")], f"layer {i}: cache layer entered as {writes}"
        extra = trip.reentries()
        over = {f: n for f, n in extra.items() if n > REENTRY_BOUND.get(f, 0)}
        assert over == {}, f"layer {i}: files entered again beyond the bound: {over}"
        assert len(trip.edges) <= (38 if static else 34), f"layer {i}: {len(trip.edges)} cross-file calls"


def test_the_ranks_order_the_layers_as_design_says() -> None:
    order = ["condcomp/routed.py", "integrations/hf/projection.py", "condcomp/kv/decoder.py",
             "condcomp/executors/cached.py", "condcomp/kv/window_policy.py", "condcomp/kv/layer.py",
             "condcomp/types.py"]
    assert [rank(f) for f in order] == sorted(rank(f) for f in order) and len({rank(f) for f in order}) == len(order)
