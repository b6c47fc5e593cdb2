"""``CondCompConfig(decode_kernel=True)``: a wrapped tiny Llama's decode steps on a static cache attend the compact
cache through ``condcomp.kv.kernels.compact_decode_attention`` (one launch per layer), and its greedy tokens and
logits equal the eager compact decode's (the default dynamic cache, SDPA). Under ``TRITON_INTERPRET=1`` (the CI
step in ``.ci/run``) the op runs the Triton kernels on CPU and the test checks that they ran; in a plain run it
runs the op's torch fallback. Off by default, and never on a dynamic cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from decode_helpers import GREEDY, llama, prompts, t

import condcomp
from condcomp.executors.gathered import pairs
from condcomp.kv.kernels import fallback

NEW = 6


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The implementations the op ran, in order: ``kernel`` (Triton) or ``fallback`` (torch)."""
    ran: list[str] = []
    modules = [("fallback", fallback)]
    if pairs.triton_available():
        from condcomp.kv.kernels import launch

        modules.append(("kernel", launch))
    for name, module in modules:
        def spy(*args: Any, _name: str = name, _run: Any = module.decode_attention) -> Any:
            ran.append(_name)
            return _run(*args)

        monkeypatch.setattr(module, "decode_attention", spy)
    yield ran


def _wrapped(fraction: float, kv_heads: int, kernel: bool, attention: str = "sdpa") -> Any:
    model = llama(kv_heads=kv_heads)
    model.config._attn_implementation = attention  # eager: transformers' float masks (the dtype's minimum)
    policy = "full" if fraction == 1.0 else ("fixed", {"fraction": fraction})
    condcomp.apply_(model, condcomp.CondCompConfig(policy=policy, router=("topk", {"kv_groups": True}),
                                                   decode_kernel=kernel))
    return model.eval()


def _generate(model: Any, **extra: Any) -> Any:
    ids, mask = prompts()  # three requests, two of them left-padded
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                          output_logits=True, **GREEDY, **extra)


@pytest.mark.parametrize("fraction,kv_heads,attention", [(1 / 3, 8, "sdpa"), (0.5, 4, "sdpa"), (1.0, 2, "sdpa"),
                                                        (0.5, 4, "eager")])  # 4, 2: 2 and 4 heads per group
def test_greedy_decoding_with_the_kernel_equals_the_eager_compact_decode(fraction: float, kv_heads: int,
                                                                          attention: str,
                                                                          launches: list[str]) -> None:
    eager = _generate(_wrapped(fraction, kv_heads, kernel=False, attention=attention))
    assert launches == []
    out = _generate(_wrapped(fraction, kv_heads, kernel=True, attention=attention), cache_implementation="static")
    assert torch.equal(out.sequences, eager.sequences)
    for step, (got, want) in enumerate(zip(out.logits, eager.logits, strict=True)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"logits of generated token {step}")
    layers = 2
    assert len(launches) == (NEW - 1) * layers  # every decode step of every layer, never the prefill
    expected = "kernel" if pairs.interpreting() and pairs.triton_available() else "fallback"
    assert set(launches) == {expected}


def test_off_by_default_and_never_on_a_dynamic_cache(launches: list[str]) -> None:
    assert condcomp.CondCompConfig().decode_kernel is False
    _generate(_wrapped(1 / 3, 8, kernel=False), cache_implementation="static")
    _generate(_wrapped(1 / 3, 8, kernel=True))  # the default DynamicCache: no device count of tokens to read to
    assert launches == []


@pytest.mark.slow
def test_compiled_generate_with_the_kernel_equals_the_eager_compact_decode(launches: list[str]) -> None:
    compiles = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any, **options: Any) -> Any:
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    config = t.CompileConfig(fullgraph=True, backend=counting)
    config._compile_all_devices = True  # transformers compiles off CUDA only when told to ("for testing")
    eager = _generate(_wrapped(1 / 3, 4, kernel=False))
    torch._dynamo.reset()
    out = _generate(_wrapped(1 / 3, 4, kernel=True), cache_implementation="static", compile_config=config)
    assert torch.equal(out.sequences, eager.sequences)
    assert len(compiles) == 1, f"the decode forward compiled {len(compiles)} times over {NEW - 1} steps"
    assert len(launches) == (NEW - 1) * 2


def test_the_switch_round_trips_and_refuses_a_string() -> None:
    config = condcomp.CondCompConfig(decode_kernel=True)
    assert condcomp.CondCompConfig.from_dict(config.to_dict()) == config
    with pytest.raises(TypeError, match="decode_kernel must be True or False"):
        condcomp.CondCompConfig(decode_kernel="false")


def test_a_window_split_with_the_kernel_equals_the_eager_compact_decode(launches: list[str]) -> None:
    """Kept groups through the kernel, the other groups in their window ring (the policy's own attention) in the
    same step: the DuoAttention-style split, its tokens and logits as the eager decode on the default cache."""
    def split(kernel: bool, window: int = 5) -> Any:
        model = llama(kv_heads=4)
        condcomp.apply_(model, condcomp.CondCompConfig(
            policy=("fixed", {"fraction": 0.5}), router=("topk", {"kv_groups": True}),
            kv=("window", {"sinks": 2, "window": window}), decode_kernel=kernel))
        return model.eval()

    eager = _generate(split(False))
    # the window binds: with room for every token, the streamed groups' last logits differ
    assert not torch.allclose(_generate(split(False, window=64)).logits[-1], eager.logits[-1])
    out = _generate(split(True), cache_implementation="static")
    assert torch.equal(out.sequences, eager.sequences)
    for got, want in zip(out.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(launches) == (NEW - 1) * 2  # the kept groups of both layers at every decode step


def test_a_headkv_split_with_the_kernel_equals_its_eager_decode(launches: list[str]) -> None:
    """``headkv_split(..., decode_kernel=True)``: the full groups through the kernel, the ``headkv`` groups through
    the policy's own attention, in the same step; tokens and logits as the same split's eager decode on the default
    cache (SDPA)."""
    from condcomp.kv.headkv_budget import allocate_group_budgets, headkv_split

    scores = torch.tensor([[0.9, 0.5, 0.7, 0.5], [0.5, 0.8, 0.5, 0.6]])  # (layers, KV groups)

    def split(kernel: bool) -> Any:
        return headkv_split(llama(kv_heads=4), scores, 0.6, floor=0.125, sinks=2, observe=4, pool=3,
                            decode_kernel=kernel)

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 97, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    run = dict(attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True, **GREEDY)
    eager = split(False).generate(input_ids=ids, **run)
    assert launches == []
    out = split(True).generate(input_ids=ids, cache_implementation="static", **run)
    assert torch.equal(out.sequences, eager.sequences)
    for step, (got, want) in enumerate(zip(out.logits, eager.logits, strict=True)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"logits of generated token {step}")
    full = allocate_group_budgets(scores, 0.6, floor=0.125, entry_overhead=8 / (2 * 8 * 4), empty_layer=1 / 8).full
    assert bool(full.any()) and not bool(full.all(-1).any())  # full groups and headkv groups in the split
    assert len(launches) == (NEW - 1) * int(full.any(-1).sum())  # the layers with a full group, every decode step
    expected = "kernel" if pairs.interpreting() and pairs.triton_available() else "fallback"
    assert set(launches) == {expected}
