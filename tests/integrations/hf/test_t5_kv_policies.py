"""T5's decoder self-attention under the KV policies that keep a state of their own (``window``, ``snapkv``,
``adakv``): each kept key gets T5's relative position bias of its true distance from the query.

Oracle: :mod:`t5_rule`, the policy's rule and T5's biased attention written from scratch in float64 (the kept token
set, then attention over it), one cache-free forward over every token. Prefill then decode by hand, batched rows
with different plans, left-padded decoder prompts, rows reordered and repeated as beam search does, crop; a policy
that cannot add the bias is refused at ``apply_``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decode_helpers import TOL, P, extend, prompts
from family_oracles import T5_DECODER_SELF, new_cache, t5
from t5_rule import t5_rule_logits
from test_decoder_families_kv import NEW, encoder_inputs, rows_differ, wrapped
from torch import Tensor, nn

import condcomp

t = pytest.importorskip("transformers")

POLICIES = {
    "window": ("window", {"sinks": 1, "window": 3}),
    "snapkv": ("snapkv", {"budget": 1, "observe": 2, "pool": 1}),
    "adakv": ("adakv", {"budget": 1, "observe": 2, "pool": 3}),
}


def t5_prompt(padded: bool) -> tuple[Tensor, Tensor]:
    """Decoder prompts ``(3, P)``: each row starts with the decoder start token; left padding when ``padded``."""
    ids, mask = prompts()
    if not padded:
        mask = torch.ones_like(mask)
    first = (mask.cumsum(-1) == 1) & mask.bool()  # each row's first real token
    return torch.where(first, torch.zeros_like(ids), ids), mask


@torch.no_grad()
def forward(model: nn.Module, rows: Tensor, tokens: Tensor, mask: Tensor, cache: Any, new: int) -> Tensor:
    """Logits ``(B, new, V)`` of the last ``new`` decoder tokens; ``rows``: each row's encoder input row."""
    enc = {k: v[rows] for k, v in encoder_inputs().items()}
    return model(**enc, decoder_input_ids=tokens[:, -new:], decoder_attention_mask=mask, cache=cache,  # type: ignore
                 use_cache=True).logits[:, -new:]


def oracle(model: nn.Module, kv: Any, cache: Any, rows: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
    plans = condcomp.request_plans(model, cache)
    enc = {k: v[rows] for k, v in encoder_inputs().items()}
    return t5_rule_logits(model, plans, kv, enc, tokens, mask, P)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", list(POLICIES))
def test_prefill_then_decode_equals_the_rule_with_t5s_bias_in_float64(name: str, padded: bool) -> None:
    kv = POLICIES[name]
    model = wrapped("t5", kv)
    tokens, mask = t5_prompt(padded)
    rows = torch.arange(3)
    cache = new_cache("t5")
    logits = [forward(model, rows, tokens, mask, cache, P)[:, -1]]
    for _ in range(NEW):
        tokens, mask = extend(tokens, mask, logits[-1].argmax(-1, keepdim=True))
        logits.append(forward(model, rows, tokens, mask, cache, 1)[:, -1])
    plans = condcomp.request_plans(model, cache)
    assert rows_differ(plans)
    assert {m for p in plans.values() for row in p.group_modes() for m in row} == {"full", name}
    want = oracle(model, kv, cache, rows, tokens, mask)
    for i, got in enumerate(logits):
        torch.testing.assert_close(got.double(), want[:, P - 1 + i], **TOL, msg=f"{name} step {i}")
    # the bias matters: the same policy's rule without it is far from what the model computed
    if not padded and name == "window":
        flat = model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        with torch.no_grad():
            saved = flat.clone()
            flat.zero_()
            try:
                unbiased = oracle(model, kv, cache, rows, tokens, mask)
            finally:
                flat.copy_(saved)
        assert not torch.allclose(logits[-1].double(), unbiased[:, -1], **TOL)


@pytest.mark.parametrize("name", list(POLICIES))
def test_rows_reordered_and_repeated_as_beams_then_crop_equal_the_rule(name: str) -> None:
    kv = POLICIES[name]
    model = wrapped("t5", kv)
    tokens, mask = t5_prompt(True)
    rows = torch.arange(3)
    cache = new_cache("t5")
    nxt = forward(model, rows, tokens, mask, cache, P)[:, -1].argmax(-1, keepdim=True)
    tokens, mask = extend(tokens, mask, nxt)
    forward(model, rows, tokens, mask, cache, 1)
    order = torch.tensor([2, 0, 0])  # beam search: rows reordered and repeated
    cache.reorder_cache(order)
    rows, tokens, mask = rows[order], tokens[order], mask[order]
    logits = []
    for nxt in (torch.tensor([[5], [6], [7]]), torch.tensor([[8], [9], [10]])):
        tokens, mask = extend(tokens, mask, nxt)
        logits.append(forward(model, rows, tokens, mask, cache, 1)[:, -1])
    want = oracle(model, kv, cache, rows, tokens, mask)
    for i, got in enumerate(logits):
        torch.testing.assert_close(got.double(), want[:, -2 + i], **TOL, msg=f"{name} after reorder, step {i}")
    if name != "window":  # a window of 3 evicted what a crop would need: test_a_window_crop_equals_the_rule
        crop_and_feed_again(model, kv, cache, rows, tokens, mask)


def crop_and_feed_again(model: nn.Module, kv: Any, cache: Any, rows: Tensor, tokens: Tensor, mask: Tensor) -> None:
    """Forget the last token (not a prompt one), feed another in its place: the rule's logits."""
    cache.crop(-1)
    tokens, mask = extend(tokens[:, :-1], mask[:, :-1], torch.tensor([[11], [12], [13]])[:tokens.shape[0]])
    got = forward(model, rows, tokens, mask, cache, 1)[:, -1]
    torch.testing.assert_close(got.double(), oracle(model, kv, cache, rows, tokens, mask)[:, -1], **TOL)


def test_a_window_crop_equals_the_rule() -> None:
    kv = ("window", {"sinks": 1, "window": 12})  # nothing evicted within the test's tokens, so crop may go back
    model = wrapped("t5", kv)
    tokens, mask = t5_prompt(True)
    rows = torch.arange(3)
    cache = new_cache("t5")
    for new in (P, 1, 1):
        nxt = forward(model, rows, tokens, mask, cache, new)[:, -1].argmax(-1, keepdim=True)
        tokens, mask = extend(tokens, mask, nxt)
    forward(model, rows, tokens, mask, cache, 1)
    crop_and_feed_again(model, kv, cache, rows, tokens, mask)


def test_greedy_generate_equals_decoding_by_hand() -> None:
    kv = POLICIES["snapkv"]
    model = wrapped("t5", kv)
    tokens, mask = t5_prompt(True)
    rows = torch.arange(3)
    cache = new_cache("t5")
    logits = forward(model, rows, tokens, mask, cache, P)[:, -1]
    by_hand = tokens
    for _ in range(NEW):
        by_hand, mask = extend(by_hand, mask, logits.argmax(-1, keepdim=True))
        logits = forward(model, rows, by_hand, mask, cache, 1)[:, -1]
    start, start_mask = t5_prompt(True)
    got = model.generate(**encoder_inputs(), decoder_input_ids=start, decoder_attention_mask=start_mask,
                         max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(got, by_hand)


def test_a_policy_that_cannot_add_the_position_bias_is_refused_on_t5() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "kv"))
    import sinks_only_policy  # noqa: F401  (registers "sinks_only", which does not read a position bias)

    fresh = t5(seed=1)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk", kv=("sinks_only", {}),
                                  target_modules=[T5_DECODER_SELF])
    with pytest.raises(ValueError, match=r"apply_: .*T5's decoder: a policy with a state of its own must add"):
        condcomp.apply_(fresh, cfg)
    assert condcomp.routed_modules(fresh) == {}


@pytest.mark.parametrize("name", ["window", "snapkv"])
def test_padding_between_real_tokens_is_refused_under_the_position_bias(name: str) -> None:
    # T5 measures a key's distance in cache indices, the policies in real tokens: they differ across a hole
    model = wrapped("t5", POLICIES[name])
    tokens, mask = t5_prompt(False)
    right = mask.clone()
    right[0, -2:] = 0  # right padding: later tokens would sit after a hole
    with pytest.raises(ValueError, match="relative position bias.*padding_side='left'"):
        forward(model, torch.arange(3), tokens, right, new_cache("t5"), P)
    cache = new_cache("t5")
    forward(model, torch.arange(3), tokens, mask, cache, P)
    tokens, mask = extend(tokens, mask, torch.tensor([[5], [6], [7]]))
    mask[1, -1] = 0  # a padded token after the first call
    with pytest.raises(ValueError, match="relative position bias"):
        forward(model, torch.arange(3), tokens, mask, cache, 1)


@pytest.mark.parametrize("mode", [{"do_sample": False}, {"do_sample": False, "num_beams": 3}, {"do_sample": True}])
def test_policies_that_keep_everything_generate_what_the_full_cache_does_past_t5s_max_distance(mode: dict) -> None:
    # a window/budget larger than the request: the policies keep every token in their own state and add the bias
    # from RelativeBias; kv='full' reads the same tokens from the cache with T5's dense bias. 3 heads of 8, 4 buckets
    # saturating at distance 3, 20 generated tokens: most distances lie beyond relative_attention_max_distance
    def model(kv: Any) -> nn.Module:
        torch.manual_seed(0)
        config = t.T5Config(d_model=24, d_kv=8, d_ff=37, num_layers=2, num_heads=3, vocab_size=97,
                            decoder_start_token_id=0, relative_attention_num_buckets=4,
                            relative_attention_max_distance=3)
        config._attn_implementation = "sdpa"
        m = t.T5ForConditionalGeneration(config).eval()
        condcomp.apply_(m, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.67}), router="topk", kv=kv,
                                                   target_modules=[T5_DECODER_SELF]))
        return m.eval()

    def generate(m: nn.Module) -> tuple[Tensor, Tensor]:
        torch.manual_seed(5)
        out = m.generate(**encoder_inputs(), max_new_tokens=20, min_new_tokens=20, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True, **mode)
        return out.sequences, torch.stack(out.scores).nan_to_num(0.0, 0.0, 0.0)

    want_tokens, want_scores = generate(model("full"))
    for kv in [("window", {"sinks": 1, "window": 64}), ("snapkv", {"budget": 64, "observe": 2, "pool": 1}),
               ("adakv", {"budget": 64, "observe": 2, "pool": 3})]:
        tokens, scores = generate(model(kv))
        assert torch.equal(tokens, want_tokens), kv
        torch.testing.assert_close(scores, want_scores, **TOL, msg=str(kv))


def _compile_config(backend: Any) -> Any:
    config = t.CompileConfig(fullgraph=True, backend=backend)
    config._compile_all_devices = True  # transformers compiles off CUDA only when told to ("for testing")
    return config


def _t5_generate(model: nn.Module, **extra: Any) -> Any:
    start, start_mask = t5_prompt(True)
    return model.generate(**encoder_inputs(), decoder_input_ids=start, decoder_attention_mask=start_mask,
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          output_logits=True, **extra)


@pytest.mark.parametrize("kv", ["drop", "full"])
def test_t5_decodes_compiled_on_a_static_cache_as_the_eager_compact_decode(kv: str) -> None:
    # T5's position bias on a static cache: the table of distances is read at the layer's device count of tokens
    # (a host read there was a data-dependent guard that torch.compile refused)
    model = wrapped("t5", kv)
    eager = _t5_generate(model)  # the default cache, no compile
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any, **options: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = _t5_generate(model, cache_implementation="static", compile_config=_compile_config(counting))
    assert torch.equal(out.sequences, eager.sequences)
    for got, want in zip(out.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert len(graphs) == 1, f"the decode forward compiled {len(graphs)} times over {NEW - 1} steps"
    if kv == "drop":  # rows keep different groups (a row mix-up would show)
        assert rows_differ(condcomp.request_plans(model, out.past_key_values))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["window", "snapkv"])
def test_a_policy_with_slots_on_t5s_static_cache_is_refused_by_name_at_the_prefill(name: str, compiled: bool) -> None:
    # refused at the prefill (eager): met inside a compiled decode step it was torch.compile's error, not this one
    model = wrapped("t5", POLICIES[name])
    extra = {"compile_config": _compile_config("eager")} if compiled else {}
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=rf"KV policy '{name}' on a static cache cannot add a relative position "
                                         r"bias \(T5\).*default DynamicCache"):
        _t5_generate(model, cache_implementation="static", **extra)


def test_the_distance_table_read_at_a_device_count_equals_the_host_one() -> None:
    from condcomp.kv.position_bias import RelativeBias

    H, T, S, last = 3, 2, 9, 6  # two queries at cache indices 5 and 6 of a 9-slot static cache
    by_distance = torch.randn(1, H, S)  # the bias of a key d tokens back
    i, j = torch.arange(last - T + 1, last + 1)[:, None], torch.arange(S)[None, :]
    bias = by_distance[:, :, (i - j).clamp_min(0)]  # (1, H, T, S), as T5's compute_bias (keys after: masked)
    host, device = RelativeBias.from_scores(bias, last), RelativeBias.from_scores(bias, torch.tensor(last))
    assert device.table.shape == (1, H, S)  # the static cache's width, whatever the count
    torch.testing.assert_close(device.table[..., :last + 1], host.table, rtol=0, atol=0)
    query, key = torch.tensor([[5, 6]]), torch.tensor([[0, 2, 4, 5, 6]])  # real-token positions, keys <= queries
    heads = torch.arange(H)[None]
    torch.testing.assert_close(device.for_heads(heads).at(query, key), host.for_heads(heads).at(query, key),
                               rtol=0, atol=0)
