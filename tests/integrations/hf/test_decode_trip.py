"""A decode step reads one way (DESIGN, v0.5): adapter -> base decoder sequence -> executor -> KV policy -> cache
layer, traced call by call with ``sys.setprofile`` (:mod:`decode_trip`) on the bench's tiny Llama keeping 1/4 of
its KV groups (``keep_0.25``: the others dropped; ``stream_0.25``: the others in a streaming window), one decode
step of 2 requests after a 16-token prefill (4 layers).

Per step, before (main at 46b179a) -> after this layout, ``DynamicCache`` / ``StaticCache``:

- ``keep_0.25``: cross-file calls 256 / 256 -> 128 / 144; calls climbing back up a layer 48 / 48 -> 0 / 0; files
  entered again from another file (helpers left out) 136 / 120 -> 16 / 16;
- ``stream_0.25``: cross-file calls 364 / 320 -> 212 / 204; climbs 68 / 52 -> 0 / 0; re-entries 204 / 152 ->
  64 / 48.

The climbs were ``RoutedAttention.__getattr__`` for each projection, ``layout`` / ``weights`` / ``notices`` read
back from the wrapped module, ``internals`` and ``kv/layer.py`` calling ``PlanLayer``'s attribute fallback and its
``fixed_slot_room`` / ``state_codec``, and the cache layer calling the KV policy to load and store its state. What
is still entered twice: the executor file (``resolve_executor``'s ``supports`` and ``prepare``, the run, its usage
record: the executor protocol), the KV selection (the held plan's check at the top, its ``slots`` read by the
executor), and, with a window, the policy's own files (``policy.py``, ``window_policy.py``, ``window.py``) calling
each other. The tiny GPT-2, Qwen3, Mixtral and Gemma of ``arch_models`` decode without a climb as well (GPT-2
climbed 6 times per layer before: ``base`` and its modules through ``__getattr__``). Run
``python tests/integrations/hf/decode_trip.py keep_0.25 stream_0.25`` for the edges.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from decode_trip import decode_step_trips, family_step_trips, rank, tiny_llama  # noqa: E402

# per layer call: (most cross-file calls, most re-entries of layered files) for a DynamicCache / a StaticCache
BOUNDS = {("keep_0.25", False): (32, 4), ("keep_0.25", True): (36, 4),
          ("stream_0.25", False): (53, 16), ("stream_0.25", True): (51, 12)}
SEQUENCE, CACHE_LAYER = "condcomp/kv/decoder.py", "condcomp/kv/layer.py"


@pytest.mark.parametrize("variant", ["keep_0.25", "stream_0.25"])
def test_a_decode_step_goes_down_one_way(variant: str) -> None:
    model = tiny_llama(variant)
    for static in (False, True):
        trips = decode_step_trips(model, static)
        assert len(trips) == model.config.num_hidden_layers  # one traced call per wrapped layer
        most_calls, most_reentries = BOUNDS[(variant, static)]
        for i, trip in enumerate(trips):
            where = f"{variant}, {'static' if static else 'dynamic'} cache, layer {i}"
            assert trip.climbs == [], f"{where}: calls climbing back up: {trip.climbs}"
            down = [(a, b) for a, b, _ in trip.edges if b == SEQUENCE]
            assert down == [("integrations/hf/decode.py", SEQUENCE)], (
                f"{where}: the adapter should hand the call to the base decoder sequence once, got {down}")
            assert not any(a.startswith("condcomp/kv/") and b.startswith("integrations/") for a, b, _ in trip.edges)
            into_layer = {(a, fn) for a, b, fn in trip.edges if b == CACHE_LAYER}
            assert ("condcomp/executors/cached.py", "store") in into_layer and all(
                a == "condcomp/executors/cached.py" or rank(a) == rank("condcomp/kv/policy.py")
                for a, _ in into_layer), f"{where}: the cache layer entered from {into_layer}"
            reentries = sum(trip.reentries().values())
            assert reentries <= most_reentries, f"{where}: files entered again: {trip.reentries()}"
            assert len(trip.edges) <= most_calls, f"{where}: {len(trip.edges)} cross-file calls"


def test_the_ranks_order_the_layers_as_design_says() -> None:
    order = ["condcomp/routed.py", "integrations/hf/projection.py", SEQUENCE, "condcomp/executors/cached.py",
             "condcomp/kv/window_policy.py", CACHE_LAYER, "condcomp/types.py"]
    assert [rank(f) for f in order] == sorted(rank(f) for f in order) and len({rank(f) for f in order}) == len(order)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3", "mixtral", "gemma"])
def test_every_decoder_family_decodes_without_climbing_back_up(arch: str) -> None:
    for i, trip in enumerate(family_step_trips(arch)):
        assert trip.climbs == [], f"{arch}, layer {i}: calls climbing back up: {trip.climbs}"
        assert [b for _, b, _ in trip.edges].count(SEQUENCE) == 1, f"{arch}, layer {i}: {trip.edges}"
