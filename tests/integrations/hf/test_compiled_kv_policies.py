"""KV policies that hold a fixed number of slots after the prefill (``window``, ``snapkv``, ``adakv``, ``headkv``,
the DuoAttention split, a per-request split) on a static cache under ``torch.compile``: captured whole, compiled once
for a generation, token-identical to the eager compact decode on the default cache, their logits equal to the
float64 rule's reference (the per-head reference executor without a cache, masked entry by entry), their bytes
counted by hand, and cache operations (beam reordering, crop, a second turn) between compiled steps.

``backend`` is a counting backend that runs the captured graph as it is (what is checked is the capture: a host
read would be a graph break, a Python counter a recompilation), the CPU proxy of a CUDA graph capture."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from condcomp.integrations.hf.cache import cache_bytes
from decode_helpers import GREEDY, TOL, P, llama, positions, prompts, t

import condcomp
from condcomp.kv.calibration import duo_split
from condcomp.kv.duo_gates import save_gates
from condcomp.kv.fixed_slots import RingWindow, SlotRegion
from condcomp.testing_kv import rule_logits

SINKS, WINDOW = 1, 4  # a ring of 4 after 1 sink: 6-token prompts and 8 new tokens wrap it twice
NEW = 8
MAX_LEN = 24
WINDOW_KV = ("window", {"sinks": SINKS, "window": WINDOW})
POLICIES: dict[str, Any] = {
    "window": WINDOW_KV,
    "snapkv": ("snapkv", {"budget": 2, "observe": 1, "pool": 1}),
    "adakv": ("adakv", {"budget": 2, "observe": 1, "pool": 1}),
    "headkv": ("headkv", {"shares": (0.5, 0.25, 1.0, 0.75), "sinks": 1, "observe": 1, "pool": 1}),  # per group
}


def window_rule(p: int, j: int) -> bool:
    return j < SINKS or p - j < WINDOW


def _wrapped(kv: Any, fraction: float = 1 / 3) -> Any:
    model = llama(kv_heads=4)  # GQA: two query heads per key/value group
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": fraction}),
                                                   router=("topk", {"kv_groups": True}), kv=kv))
    return model.eval()


def _duo(tmp_path: Path) -> Any:
    """DuoAttention's split from a gates file: the top third of (layer, group) pairs full, all in layer 0, so
    layer 1 streams every group (no group in the static layer's storage but a placeholder)."""
    path = tmp_path / "gates.json"
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.5], [0.1, 0.2, 0.3, 0.05]])
    save_gates(path, "duo", "tiny-llama", scores, SINKS, WINDOW, {})
    return duo_split(llama(kv_heads=4), path, 1 / 3)


def _model(variant: str, tmp_path: Path) -> Any:
    if variant == "duo-split":
        return _duo(tmp_path)
    if variant == "request-split":  # a topk router per layer picks each prompt's full groups; the rest stream
        return _wrapped(WINDOW_KV, fraction=0.5)
    return _wrapped(POLICIES[variant])


class Counting:
    """A backend counting the graphs compiled (every recompilation reaches it) and running each as captured; a
    plain function (``backend``), as transformers' compile config takes one."""

    def __init__(self) -> None:
        self.graphs = 0

        def backend(gm: torch.fx.GraphModule, example_inputs: Any, **options: Any) -> Any:
            self.graphs += 1
            return gm.forward

        self.backend = backend


def _config(backend: Any) -> Any:
    config = t.CompileConfig(fullgraph=True, backend=getattr(backend, "backend", backend))
    config._compile_all_devices = True  # transformers compiles off CUDA only when told to ("for testing")
    return config


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, backend: Any | None, cache: Any = None,
              new: int = NEW) -> Any:
    extra: dict[str, Any] = {"past_key_values": cache} if cache is not None else {"cache_implementation": "static"}
    if backend is not None:
        extra["compile_config"] = _config(backend)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True,
                          output_logits=True, **extra, **GREEDY)


def _states(cache: Any) -> list[str]:
    return [type(layer.condcomp_windows).__name__ for layer in cache.layers]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["window", "snapkv", "adakv", "headkv", "duo-split", "request-split"])
def test_compiled_static_generate_equals_the_eager_compact_decode(variant: str, tmp_path: Path) -> None:
    model = _model(variant, tmp_path)
    ids, mask = prompts()
    eager = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                           output_logits=True, **GREEDY)  # the default DynamicCache, no compile
    counting = Counting()
    torch._dynamo.reset()
    out = _generate(model, ids, mask, counting)
    assert torch.equal(out.sequences, eager.sequences)
    for got, want in zip(out.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert counting.graphs == 1, f"the decode forward compiled {counting.graphs} times over {NEW - 1} steps"
    fixed = {"snapkv": "SlotRegion", "adakv": "SlotRegion", "headkv": "SlotRegion"}.get(variant, "RingWindow")
    assert set(_states(out.past_key_values)) == {fixed}  # the policy's state was preallocated, not grown
    if variant == "request-split":  # rows keep different full groups (the others stream)
        plans = condcomp.request_plans(model, out.past_key_values).values()
        assert any(len({tuple(g) for g in p.kept_kv_groups()}) > 1 for p in plans)
    if variant == "duo-split":  # layer 1 keeps no group in full: only its placeholder is in the static layer
        assert int(out.past_key_values.layers[1].keys.shape[1]) == 1
        assert int(out.past_key_values.layers[1].keys.shape[-1]) == 1


def test_one_window_decode_step_is_captured_with_no_graph_break() -> None:
    model = _wrapped(WINDOW_KV)
    ids, mask = prompts()
    cache = t.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache,
                      use_cache=True).logits[:, -1:].argmax(-1)
    grown = torch.cat([mask, torch.ones_like(token)], 1)

    def step(token: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
                     use_cache=True).logits[:, -1]  # type: ignore[no-any-return]

    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(step)(token, grown, grown.sum(-1, keepdim=True) - 1)
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons
    assert _states(cache) == ["RingWindow", "RingWindow"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["window", "duo-split", "snapkv-whole"])
def test_compiled_logits_follow_the_float64_rule(variant: str, tmp_path: Path) -> None:
    """``snapkv-whole``: a budget above every prompt, so SnapKV keeps every token and its rule is causal: what the
    region's writes and reads must give."""
    if variant == "snapkv-whole":
        model, rule = _wrapped(("snapkv", {"budget": 2 * P, "observe": 1, "pool": 1})), (lambda p, j: True)
    else:
        model, rule = _model(variant, tmp_path), window_rule
    ids, mask = prompts()
    torch._dynamo.reset()
    out = _generate(model, ids, mask, Counting())
    tokens = out.sequences
    full = torch.cat([mask, torch.ones(mask.shape[0], NEW, dtype=mask.dtype)], 1)
    want = rule_logits(model, condcomp.request_plans(model, out.past_key_values), tokens, full, rule)
    for i, got in enumerate(out.logits):
        torch.testing.assert_close(got, want[:, P - 1 + i], **TOL)


@pytest.mark.parametrize("variant", ["window", "snapkv"])
def test_bytes_held_counted_by_hand(variant: str) -> None:
    """Per layer: the static layer's kept groups (B, g, MAX_LEN, Dh) keys and values and its int64 count, and the
    policy's slots: the ring (sinks + window) or the region (the largest selection plus the static cache's room),
    with their int64 counts."""
    model = _wrapped(POLICIES[variant])
    ids, mask = prompts()
    cache = t.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    out = _generate(model, ids, mask, None, cache=cache, new=4)
    B, Dh, f32, i64 = ids.shape[0], 8, 4, 8
    plans = condcomp.request_plans(model, out.past_key_values)
    real = mask.sum(-1).tolist()  # 6, 4, 2 real prompt tokens
    for layer_bytes, plan in zip(cache_bytes(out.past_key_values), plans.values(), strict=True):
        g = max(len(groups) for groups in plan.kept_kv_groups())
        assert plan.kv_modes is not None
        gw = int((plan.kv_modes == condcomp.kv.KV_WINDOW).sum(-1).max())
        held = 2 * B * g * MAX_LEN * Dh * f32 + i64
        if variant == "window":
            state = 2 * B * gw * (SINKS + WINDOW) * Dh * f32 + B * i64 + B * gw * i64
        else:  # each group keeps min(prompt, budget 2 + observe 1) prompt tokens; room: MAX_LEN - P columns
            n = max(min(r, 3) for r in real)
            state = 2 * B * gw * (n + MAX_LEN - P) * Dh * f32 + B * gw * i64 + 2 * B * i64
        assert layer_bytes == held + state


@pytest.mark.slow
def test_beam_reordering_and_crop_between_compiled_window_steps() -> None:
    """Between compiled steps (as generate() calls them): beams reorder the ring's rows in place, a crop of one
    token rolls its count back (the next token overwrites its slot); logits against the float64 rule on the rows as
    they now are, one compilation in all."""
    model = _wrapped(WINDOW_KV)
    ids, mask = prompts()
    cache = t.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache,
                      use_cache=True).logits[:, -1:].argmax(-1)
    counting = Counting()
    torch._dynamo.reset()

    def forward(token: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
                     use_cache=True).logits[:, -1]  # type: ignore[no-any-return]

    step = torch.compile(forward, backend=counting.backend, fullgraph=True)
    padded = torch.cat([mask, mask.new_zeros(mask.shape[0], MAX_LEN - P)], 1)  # as generate() passes it
    tokens = ids

    def advance(token: torch.Tensor) -> torch.Tensor:
        nonlocal tokens, padded
        tokens, padded = torch.cat([tokens, token], 1), padded.clone()
        padded[:, tokens.shape[1] - 1] = 1
        return step(token, padded, padded.sum(-1, keepdim=True) - 1)  # type: ignore[no-any-return]

    def rule(logits: torch.Tensor) -> None:
        full = padded[:, :tokens.shape[1]]
        want = rule_logits(model, condcomp.request_plans(model, cache), tokens, full, window_rule)
        torch.testing.assert_close(logits, want[:, -1], **TOL)

    with torch.no_grad():
        for _ in range(6):  # past the ring's first wrap
            token = advance(token).argmax(-1, keepdim=True)
        order = torch.tensor([2, 0, 0])  # beams: rows continue other rows' requests (one twice)
        keys = cache.layers[0].condcomp_windows.keys
        cache.reorder_cache(order)
        assert cache.layers[0].condcomp_windows.keys is keys  # in place: the address a captured step reads
        tokens, padded, token = tokens[order], padded[order], token[order]
        logits = advance(token)
        rule(logits)
        cache.crop(-1)  # roll the last token back and decode another in its place
        tokens, padded = tokens[:, :-1], padded.clone()
        padded[:, tokens.shape[1]] = 0
        logits = advance((token + 1) % 97)
        rule(logits)
        with pytest.raises(ValueError, match="overwrote tokens the next query would read"):
            cache.crop(-2)
    assert counting.graphs == 1, f"{counting.graphs} compilations (1 expected: the warm-up)"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["window", "snapkv"])
def test_a_second_turn_on_the_static_cache_equals_the_eager_decode(variant: str) -> None:
    """A second ``generate()`` on the same static cache: the new turn's tokens in one call (the ring or region
    written from a call of several tokens), then compiled decoding; the same two turns eagerly on a DynamicCache."""
    model = _wrapped(POLICIES[variant])
    ids, mask = prompts()
    turn = torch.randint(1, 97, (ids.shape[0], 3), generator=torch.Generator().manual_seed(5))

    def two_turns(cache: Any, backend: Any) -> torch.Tensor:
        first = _generate(model, ids, mask, backend, cache=cache, new=4).sequences
        both = torch.cat([first, turn], 1)
        grown = torch.cat([mask, torch.ones(mask.shape[0], both.shape[1] - P, dtype=mask.dtype)], 1)
        return _generate(model, both, grown, backend, cache=cache, new=4).sequences  # type: ignore[no-any-return]

    eager = two_turns(t.DynamicCache(), None)
    counting = Counting()
    torch._dynamo.reset()
    compiled = two_turns(t.StaticCache(config=model.config, max_cache_len=MAX_LEN), counting)
    assert torch.equal(compiled, eager)
    assert counting.graphs == 1, f"{counting.graphs} compilations over two turns (1 expected)"


def test_a_policy_without_fixed_slots_is_refused_by_name_and_runs_eager() -> None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "kv"))
    import sinks_only_policy  # noqa: F401  (registers "sinks_only": no holds_fixed_slots)

    model = _wrapped(("sinks_only", {"sinks": 2}))
    ids, mask = prompts()
    with pytest.raises(ValueError, match="KV policy 'sinks_only'.*fixed number of slots.*static cache"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static",
                       compile_config=_config("eager"), **GREEDY)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **GREEDY)  # eager, dynamic cache
    assert out.shape == (ids.shape[0], P + 3)


@pytest.mark.slow
def test_an_fp8_cache_is_not_compileable_so_generate_runs_eager() -> None:
    """transformers 5.25 has no compileable quantized cache layer (``Fp8QuantizedLayer.is_compileable`` is False):
    with a compile config, ``generate()`` decodes eagerly on it (nothing compiled), the window quantized as the
    layer's keys, with the tokens of the same call without a compile config."""
    model = _wrapped(WINDOW_KV)
    ids, mask = prompts()
    fp8 = {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **fp8, **GREEDY)
    counting = Counting()
    torch._dynamo.reset()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, compile_config=_config(counting),
                         return_dict_in_generate=True, **fp8, **GREEDY)
    assert torch.equal(out.sequences, want)
    assert counting.graphs == 0
    assert not out.past_key_values.is_compileable
    assert not any(isinstance(layer.condcomp_windows, (RingWindow, SlotRegion)) for layer in out.past_key_values.layers)


@pytest.mark.slow
def test_the_window_split_compiled_by_inductor_equals_the_eager_compact_decode() -> None:
    """Inductor's code (the ring written in place by scatter into a graph input) gives the eager tokens; one
    compilation. Inductor builds C++ on a CPU: minutes on a shared machine."""
    model = _wrapped(WINDOW_KV)
    ids, mask = prompts()
    eager = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
    torch._dynamo.reset()
    before = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    out = _generate(model, ids, mask, "inductor")
    assert torch.equal(out.sequences, eager)
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) - before == 1
    assert _states(out.past_key_values) == ["RingWindow", "RingWindow"]
