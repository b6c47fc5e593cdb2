"""A decode step reads one way (DESIGN, v0.5): adapter -> base decoder sequence -> executor -> KV policy -> cache
layer, traced call by call with ``sys.setprofile`` (:mod:`decode_trip`) on the bench's tiny Llama keeping 1/4 of
its KV groups (``keep_0.25``: the others dropped; ``stream_0.25``: the others in a streaming window), one decode
step of 2 requests after a 16-token prefill (4 layers).

Per step (4 layers), ``DynamicCache`` / ``StaticCache``: cross-file calls, calls climbing back up a layer, files
entered again from another file (helpers left out):

- ``keep_0.25``: main at 46b179a 256 / 256 calls, 48 / 48 climbs, 136 / 120 re-entries; main at c676988 128 / 144,
  0 / 0, 16 / 16; f90ff65 104 / 120, 0 / 0, 0 / 0; now 96 / 112, 0 / 0, 0 / 0: every file is entered once per
  layer.
- ``stream_0.25``: 46b179a 364 / 320, 68 / 52, 204 / 152; c676988 212 / 204, 0 / 0, 64 / 48; f90ff65 184 / 176,
  0 / 0, 44 / 28; now 148 / 148, 0 / 0, 12 / 4.
- ``snapkv_0.25`` (the unkept groups under ``kv="snapkv"``): 9f933ff 152 / 164, 0 / 0, 20 / 20 (the executor entered
  the policy a second time for the usage record's ``keys_read``, and the selection for ``window_valid``); now
  148 / 152, 0 / 0, 16 / 8: ``attend_in`` counts the keys read, ``window_valid`` is data of the selection.

At c676988 each layer entered the executor file four times (``resolve_executor``'s ``supports`` and ``prepare``, the
run, its usage record) and the KV selection twice (the held plan's check, its ``slots`` read by the executor; three
times with a window: the strategy's). Now the executor a request's first call resolves is held by its cache layer and
runs each later call with its usage record in one call (``CachedExecutor.attend``), and the selection's slot counts are
data. At f90ff65 a ``stream_0.25`` layer's call re-entered files 11 times (DynamicCache; 7 on a StaticCache): the base
sequence read the KV policy's state (``state_in``) and asked whether the policy holds the unkept groups
(``kv_policy_of(...).needs_cache``) before the executor; the executor entered the policy files four times (``attend``,
``keep_in``, the policy's ``name`` and the window's ``capacity`` for the usage record), and the window policy called
``window.py`` four times. Now what a call needs of the policy (``holds_unkept``, ``policy_name``, ``window_keys``) is
data of the selection, decided at the request's first call; the executor enters the policy once (``KVPolicy.attend_in``:
the state read, attended, kept in the cache layer) and the window policy enters ``window.py`` once (``attend_window``).
What is still re-entered (:data:`REENTRIES`) is inherent: ``attend_in`` is a base-class method in ``policy.py`` running
hooks a subclass defines in ``window_policy.py`` (``loaded``, ``attend``, ``stored``: three entries; on a StaticCache
the ring is written in place and nothing is stored again: two; ``snapkv`` adds its ``keys_read``), and the cache layer
has two writers, the executor (the kept groups, ``store``) and the policy (its state, ``hold_state``). The tiny GPT-2,
Qwen3, Mixtral and Gemma of ``arch_models`` decode with no file entered twice, as ``keep_0.25`` does (c676988: the
executor file 3 times more, 4 for GPT-2, whose adapter built its fused projections there, and the selection once more).
Run ``python tests/integrations/hf/decode_trip.py keep_0.25 stream_0.25 snapkv_0.25`` for the edges.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from decode_trip import decode_step_trips, family_step_trips, rank, tiny_llama  # noqa: E402

# per layer call: the most cross-file calls, for a DynamicCache / a StaticCache
CALLS = {("keep_0.25", False): 24, ("keep_0.25", True): 28, ("stream_0.25", False): 37, ("stream_0.25", True): 37,
         ("snapkv_0.25", False): 37, ("snapkv_0.25", True): 38}
# per layer call: the most times a file is entered again from another file (helpers left out; a file not named: 0)
KV = "condcomp/kv/"
REENTRIES: dict[tuple[str, bool], dict[str, int]] = {
    ("keep_0.25", False): {}, ("keep_0.25", True): {},
    ("stream_0.25", False): {KV + "window_policy.py": 2, KV + "layer.py": 1},
    ("stream_0.25", True): {KV + "window_policy.py": 1},
    ("snapkv_0.25", False): {KV + "snapkv.py": 3, KV + "layer.py": 1},
    ("snapkv_0.25", True): {KV + "snapkv.py": 2}}
EXECUTOR, SELECTION = "condcomp/executors/cached.py", "condcomp/kv/selection.py"
POLICY = "condcomp/kv/policy.py"
SEQUENCE, CACHE_LAYER = "condcomp/kv/decoder.py", "condcomp/kv/layer.py"


@pytest.mark.parametrize("variant", ["keep_0.25", "stream_0.25", "snapkv_0.25"])
def test_a_decode_step_goes_down_one_way(variant: str) -> None:
    model = tiny_llama(variant)
    for static in (False, True):
        trips = decode_step_trips(model, static)
        assert len(trips) == model.config.num_hidden_layers  # one traced call per wrapped layer
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
            bound = REENTRIES[(variant, static)]
            over = {f: n for f, n in trip.reentries().items() if n > bound.get(f, 0)}
            assert over == {}, f"{where}: files entered again more often than {bound}: {trip.reentries()}"
            assert [(b, fn) for _, b, fn in trip.edges if b == EXECUTOR] == [(EXECUTOR, "attend")], (
                f"{where}: the executor should be entered once, for its call and usage record")
            assert [b for _, b, _ in trip.edges].count(SELECTION) == 1, f"{where}: {trip.edges}"
            # the base sequence asks the KV policy nothing; the executor enters it once per call (none without it)
            asked = [(b, fn) for a, b, fn in trip.edges if a == SEQUENCE and rank(b) == rank(POLICY)]
            assert asked == [], f"{where}: the base decoder sequence asks the KV policy files {asked}"
            into_policy = [(b, fn) for a, b, fn in trip.edges if a == EXECUTOR and rank(b) == rank(POLICY)]
            want = [] if variant.startswith("keep") else [(POLICY, "attend_in")]
            assert into_policy == want, f"{where}: the executor enters the KV policy files as {into_policy}"
            assert len(trip.edges) <= CALLS[(variant, static)], f"{where}: {len(trip.edges)} cross-file calls"


def test_the_ranks_order_the_layers_as_design_says() -> None:
    order = ["condcomp/routed.py", "integrations/hf/projection.py", SEQUENCE, "condcomp/executors/cached.py",
             "condcomp/kv/window_policy.py", CACHE_LAYER, "condcomp/types.py"]
    assert [rank(f) for f in order] == sorted(rank(f) for f in order) and len({rank(f) for f in order}) == len(order)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3", "mixtral", "gemma"])
def test_every_decoder_family_decodes_down_one_way_entering_each_file_once(arch: str) -> None:
    for i, trip in enumerate(family_step_trips(arch)):
        assert trip.climbs == [], f"{arch}, layer {i}: calls climbing back up: {trip.climbs}"
        assert [b for _, b, _ in trip.edges].count(SEQUENCE) == 1, f"{arch}, layer {i}: {trip.edges}"
        assert trip.reentries() == {}, f"{arch}, layer {i}: files entered again: {trip.reentries()}"
