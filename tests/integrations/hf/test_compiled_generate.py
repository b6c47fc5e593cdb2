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
