"""``generate()`` compiled the way transformers users ask (``cache_implementation="static"`` and a
``CompileConfig``) on a wrapped model: its greedy tokens equal the eager compact decode's (the default dynamic
cache, no compile) and the decode forward is compiled once. The KV policies with a state of their own (``window``,
``snapkv``, ``adakv``) and the policy a static cache refuses: ``test_compiled_kv_policies.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decode_helpers import GREEDY, llama, prompts, t

import condcomp

NEW = 8


def _wrapped(fraction: float, kv: Any = "drop") -> Any:
    model = llama(kv_heads=8)
    policy = "full" if fraction == 1.0 else ("fixed", {"fraction": fraction})
    condcomp.apply_(model, condcomp.CondCompConfig(policy=policy, router=("topk", {"kv_groups": True}), kv=kv))
    return model.eval()


def _compile_config(backend: Any) -> Any:
    config = t.CompileConfig(fullgraph=True, backend=backend)
    config._compile_all_devices = True  # transformers compiles off CUDA only when told to ("for testing")
    return config


@pytest.mark.slow
@pytest.mark.parametrize("fraction,kv", [(1 / 3, "drop"), (1.0, "drop"), (1 / 3, "full")])
def test_compiled_static_generate_equals_the_eager_compact_decode(fraction: float, kv: str) -> None:
    """``kv="full"``: the groups the plan does not keep are kept in full (every group cached, gates 0 for the
    unkept heads)."""
    model = _wrapped(fraction, kv)
    ids, mask = prompts()
    compiles = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any, **options: Any) -> Any:
        compiles.append(options)
        return gm.forward

    eager = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
    torch._dynamo.reset()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, cache_implementation="static",
                         compile_config=_compile_config(counting), return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, eager)
    assert len(compiles) == 1, f"the decode forward compiled {len(compiles)} times over {NEW - 1} steps"
    plans = condcomp.request_plans(model, out.past_key_values)
    kept = [max(len(g) for g in p.kept_kv_groups()) for p in plans.values()]
    compact = fraction < 1 and kv == "drop"  # kv="full" holds the groups the plan does not keep too
    assert all(k < 8 for k in kept) if compact else all(k == 8 for k in kept)
    assert [int(layer.keys.shape[1]) for layer in out.past_key_values.layers] == kept  # what the cache holds


PREFILL_REFUSED = r"first call on a KV cache .* cannot run inside torch\.compile.*prefill_chunk_size"


def test_a_chunked_prefill_compiled_with_fullgraph_is_refused_by_name() -> None:
    # generate() compiles every prefill chunk when a compile config is set: the first chunk decides the plan on the
    # host (it met a data-dependent guard deep inside the plan's slots, with no word of what to do)
    model = _wrapped(1 / 3)
    ids, mask = prompts()
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=PREFILL_REFUSED):  # torch.compile's error, quoting condcomp's
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, prefill_chunk_size=4,
                       cache_implementation="static", compile_config=_compile_config("eager"), **GREEDY)


@pytest.mark.parametrize("fullgraph", [True, pytest.param(False, marks=pytest.mark.slow)])  # False: graph breaks
def test_a_prefill_through_a_compiled_model_is_refused_with_fullgraph_and_runs_eager_without(fullgraph: bool) -> None:
    model = _wrapped(1 / 3)
    ids, mask = prompts()
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, cache=t.StaticCache(config=model.config, max_cache_len=12),
                      use_cache=True).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=fullgraph, backend="eager")
        run = lambda: compiled(input_ids=ids, attention_mask=mask,  # noqa: E731
                               cache=t.StaticCache(config=model.config, max_cache_len=12), use_cache=True).logits
        if fullgraph:
            with pytest.raises(RuntimeError, match=PREFILL_REFUSED):
                run()
        else:  # a graph break: the prefill runs eagerly, as the wrapped model decides it
            torch.testing.assert_close(run(), eager, rtol=0, atol=0)
