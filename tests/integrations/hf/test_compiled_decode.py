"""A wrapped model's decode step on a static compact cache under torch.compile: captured whole (no graph break),
compiled once (no recompilation per step), and its logits equal the reference executor's without a cache
(decode_helpers.reference_logits), at the full budget and keeping a third of the key/value groups.

``backend="eager"`` runs the captured graph as it is: what is checked is the capture (a host read would be a graph
break, a Python counter a recompilation), the CPU proxy of a CUDA graph capture (docs/llm-serving.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decode_helpers import TOL, llama, prompts, reference_logits, t, wrap

MAX_LEN = 24
STEPS = 8


def _prefilled(fraction: float, kv_heads: int = 8) -> tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The wrapped tiny Llama (8 query heads) after its padded prefill on a static cache."""
    model = wrap(llama(kv_heads=kv_heads), fraction=fraction)
    ids, mask = prompts()
    cache = t.StaticCache(config=model.config, max_cache_len=MAX_LEN)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                    past_key_values=cache, use_cache=True)
    return model, cache, ids, mask, out.logits[:, -1:].argmax(-1)


def _step(model: Any, cache: Any) -> Any:
    def step(token: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
                     use_cache=True).logits[:, -1]  # type: ignore[no-any-return]
    return step


@pytest.mark.parametrize("fraction", [1 / 3, pytest.param(1.0, marks=pytest.mark.slow)])
def test_one_decode_step_is_captured_with_no_graph_break(fraction: float) -> None:
    model, cache, ids, mask, token = _prefilled(fraction)
    grown = torch.cat([mask, torch.ones_like(token)], 1)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(_step(model, cache))(token, grown, grown.sum(-1, keepdim=True) - 1)
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


@pytest.mark.slow
@pytest.mark.parametrize("fraction,kv_heads", [(1 / 3, 8), (1.0, 8), (0.5, 4)])  # 4: two query heads per group
def test_decoding_compiled_with_fullgraph_compiles_once_and_equals_the_reference(fraction: float,
                                                                                  kv_heads: int) -> None:
    model, cache, ids, mask, token = _prefilled(fraction, kv_heads)
    compiles = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:  # every (re)compilation reaches the backend
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(_step(model, cache), backend=counting, fullgraph=True)
    tokens, got = ids, []
    padded = torch.cat([mask, mask.new_zeros(mask.shape[0], MAX_LEN - mask.shape[1])], 1)  # (B, MAX_LEN), fixed
    with torch.no_grad():
        for i in range(STEPS):
            tokens = torch.cat([tokens, token], 1)
            padded = padded.clone()
            padded[:, ids.shape[1] + i] = 1  # as generate() passes it: the whole static length, one shape per step
            logits = step(token, padded, padded.sum(-1, keepdim=True) - 1)
            got.append(logits)
            token = logits.argmax(-1, keepdim=True)
    assert len(compiles) == 1, f"{len(compiles)} compilations over {STEPS} decode steps (1 expected: the warm-up)"
    want = reference_logits(model, tokens, mask)
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, want[:, ids.shape[1] + i], **TOL)


@pytest.mark.slow
def test_beam_reordering_and_crop_between_compiled_steps_keep_each_rows_plan() -> None:
    """Cache operations run eagerly between compiled steps (as generate() calls them); the compiled step then
    continues each row with the plan that moved with it, against the reference on the reordered rows."""
    model, cache, ids, mask, token = _prefilled(1 / 3)
    torch._dynamo.reset()
    compiles = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiles.append(1)
        return gm.forward

    step = torch.compile(_step(model, cache), backend=counting, fullgraph=True)
    padded = torch.cat([mask, mask.new_zeros(mask.shape[0], MAX_LEN - mask.shape[1])], 1)
    tokens, prompt_mask = ids, mask

    def advance(token: torch.Tensor) -> torch.Tensor:
        nonlocal tokens, padded
        tokens, padded = torch.cat([tokens, token], 1), padded.clone()
        padded[:, tokens.shape[1] - 1] = 1
        return step(token, padded, padded.sum(-1, keepdim=True) - 1)

    with torch.no_grad():
        for _ in range(2):
            token = advance(token).argmax(-1, keepdim=True)
        order = torch.tensor([2, 0, 1])  # beam reordering: row i continues row order[i]'s request
        cache.reorder_cache(order)
        tokens, padded, prompt_mask, token = tokens[order], padded[order], prompt_mask[order], token[order]
        logits = advance(token)
        torch.testing.assert_close(logits, reference_logits(model, tokens, prompt_mask)[:, -1], **TOL)
        cache.crop(-1)  # roll the last token back and decode another in its place
        tokens, padded = tokens[:, :-1], padded.clone()
        padded[:, tokens.shape[1]] = 0
        other = (token + 1) % 97
        logits = advance(other)
        torch.testing.assert_close(logits, reference_logits(model, tokens, prompt_mask)[:, -1], **TOL)
    assert len(compiles) == 1, f"{len(compiles)} compilations (1 expected: the warm-up)"
