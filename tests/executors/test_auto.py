"""``executor="auto"``: the cheapest executor that can run the call (dense where nothing is worth skipping,
gathered otherwise, a third party where it is cheaper), ``condcomp.explain``, and what ``HeadUsage`` reports."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from core_helpers import leaf_plan, make_layout, make_weights, moh_active, seq_active

import condcomp
from condcomp.executors.auto import explain, get_executor, resolve_executor
from condcomp.executors.gathered import CPU, GatheredExecutor, gather_sizes, tuning_for
from condcomp.protocols import Capabilities, Estimate
from condcomp.registry import register_executor
from condcomp.types import AttentionInputs


def test_auto_runs_dense_at_full_budget_and_gathered_below() -> None:
    """At toy sizes (the size rule lifted by the pool's tuning): dense attention at full budget, gathered below;
    the dense-work bound of the tuning is where the choice flips."""
    toy = replace(CPU, min_skipped_work_sequence=0, min_skipped_work_token=0)
    pool = [GatheredExecutor(tuning=toy), get_executor("masked"), get_executor("reference")]
    w = make_weights(make_layout(H=8, Dh=4, D=32))
    x = torch.randn(4, 6, 32, dtype=torch.float64)
    full = condcomp.full_plan(4, 8, x.device)
    assert resolve_executor("auto", w, AttentionInputs(x=x), full, pool).name == "masked"
    sparse, _ = leaf_plan(seq_active([1, 2, 3, 2], 8))
    chosen = resolve_executor("auto", w, AttentionInputs(x=x), sparse, pool)
    assert chosen.name == "gathered"
    want = get_executor("reference")(w, AttentionInputs(x=x), sparse)
    torch.testing.assert_close(chosen(w, AttentionInputs(x=x), sparse), want, atol=1e-10, rtol=1e-9)
    token, _ = leaf_plan(moh_active(4, 6, 8, 1, 1))
    assert resolve_executor("auto", w, AttentionInputs(x=x), token, pool).name == "gathered"
    assert toy.prefers_dense(1.0, "token") and not toy.prefers_dense(0.25, "sequence")
    bound = toy.dense_work_sequence
    assert toy.prefers_dense(bound, "sequence") and not toy.prefers_dense(bound - 0.01, "sequence")


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_auto_runs_dense_when_the_call_is_too_small_to_pay(granularity: str) -> None:
    """Same plan shape, two sizes: where ``(1 - kept share) * B*T*D`` is below the tuning's ``min_skipped_work``
    auto runs masked, above it gathered; the bound sits between the two."""
    H, D = 8, 64
    w = make_weights(make_layout(H=H, Dh=D // H, D=D), torch.float32)
    picked, skipped = {}, {}
    for T in (4, 1024):
        x = torch.randn(8, T, D)
        if granularity == "sequence":
            plan, _ = leaf_plan(seq_active([2] * 8, H))
        else:
            plan, _ = leaf_plan(moh_active(8, T, H, 1, 1))
        share = gather_sizes(w, AttentionInputs(x=x), plan).work_fraction
        skipped[T] = (1 - share) * x.numel()
        picked[T] = resolve_executor("auto", w, AttentionInputs(x=x), plan).name
    bound = CPU.min_skipped_work_token if granularity == "token" else CPU.min_skipped_work_sequence
    assert skipped[4] < bound <= skipped[1024]
    assert picked == {4: "masked", 1024: "gathered"}
    assert CPU.prefers_dense(0.25, granularity, size=None) is False  # no size given: the share alone decides


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_auto_on_cuda_runs_dense_at_the_sizes_an_h200_measured_gathered_slower(granularity: str) -> None:
    # results/bench/gpu_check/h200: gathered slower than dense at every budget for B*T*D = 8*2048*2048 and below
    cuda, largest = tuning_for(torch.device("cuda")), 8 * 2048 * 2048
    for share in (0.125, 0.25, 0.5, 0.75):
        assert cuda.prefers_dense(share, granularity, size=largest)
    assert not CPU.prefers_dense(0.125, granularity, size=largest)  # the CPU measured the opposite
    assert not cuda.prefers_dense(0.125, granularity, size=100 * largest)  # beyond what was measured: the estimate
    assert not cuda.measured


def test_a_third_party_executor_competes_on_cost_and_explain_says_why(restore_registries: None) -> None:
    """An executor that declares capabilities and a cost below everyone else's runs under auto; one whose
    capabilities exclude the call is rejected with the capability named; ``explain`` lists every verdict and the
    gathered executor's strategies."""
    w = make_weights(make_layout(H=8, Dh=8, D=64), torch.float32)
    x = torch.randn(8, 256, 64)
    plan, _ = leaf_plan(seq_active([2, 1, 3, 2, 1, 2, 2, 1], 8))
    choice = explain(w, AttentionInputs(x=x), plan)
    assert choice.executor == "gathered" and choice.strategy == "sequence.grouped"
    assert dict(choice.strategies)["sequence.shared_set"] == ["the examples chose different head sets"]
    assert "masked: cost 1.00" in str(choice) and "strategy sequence.buckets: can run" in str(choice)

    @register_executor("cheap")
    class Cheap:
        name = "cheap"
        capabilities = Capabilities(granularities=("sequence",), devices=("cpu",))

        def supports(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return None

        def estimate(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return Estimate(0.01, note="made up")

        def __call__(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return get_executor("reference")(weights, inputs, plan)

    assert resolve_executor("auto", w, AttentionInputs(x=x), plan).name == "cheap"
    token, _ = leaf_plan(moh_active(8, 256, 8, 1, 1))
    choice = explain(w, AttentionInputs(x=x), token)
    assert choice.executor == "masked" and "cheap: cannot run: granularity 'token'" in str(choice)


def test_head_usage_names_the_executor_and_strategy() -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.25}), router="random", executor="gathered")
    layer = condcomp.RoutedAttention.wrap(condcomp.HeadAttention(64, 8), cfg)
    layer(torch.randn(4, 64, 64))
    usage = layer.head_usage()
    assert usage is not None and usage.executor == "gathered"
    assert usage.strategy in {"sequence.one_bucket", "sequence.grouped"}


def test_auto_skips_executors_that_reject_and_lists_reasons(restore_registries: None) -> None:
    w = make_weights(make_layout(H=4, Dh=4, D=16), torch.float32)
    x = torch.randn(2, 3, 16, dtype=torch.float64)  # dtype mismatch: gathered names it and declines
    plan, _ = leaf_plan(seq_active([1, 2], 4))
    assert resolve_executor("auto", w, AttentionInputs(x=x), plan).name == "masked"

    @register_executor("never")
    class Never:
        name = "never"
        granularities = ("sequence",)

        def supports(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return "never runs anything"

        def __call__(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            raise AssertionError

    with pytest.raises(RuntimeError, match="never runs anything"):
        resolve_executor("never", w, AttentionInputs(x=x), plan)


def test_auto_on_a_compact_cache_runs_the_cheapest_cache_reader(restore_registries: None) -> None:
    """A call on a compact KV cache: auto runs kv_cache (what explain says), a registered cheaper executor that
    reads a compact cache runs instead, and a per-token plan, which no cache reader runs, fails with auto's
    message naming every executor."""
    from list_cache import ListCache

    from condcomp.executors.cached import CompactKV
    from condcomp.kv.selection import select_kv

    layout = make_layout(H=4, Hkv=2, Dh=4, D=16, causal=True)
    w = make_weights(layout, torch.float32)
    seq = condcomp.plan_from_active(torch.ones(2, 4, dtype=torch.bool))
    inputs = AttentionInputs(x=torch.randn(2, 3, 16), kv_cache=CompactKV(select_kv(seq, layout), ListCache().store))
    assert resolve_executor("auto", w, inputs, seq).name == "kv_cache" == explain(w, inputs, seq).executor
    token = condcomp.plan_from_active(torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="no executor can run this call(.|\n)*kv_cache: cannot run: a per-token"):
        resolve_executor("auto", w, inputs, token)

    @register_executor("cheap_cache")
    class CheapCache:
        name = "cheap_cache"
        capabilities = Capabilities(reads_kv_cache=True)

        def supports(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return None

        def estimate(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return Estimate(-1.0, note="made up")

        def __call__(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            raise AssertionError

    assert resolve_executor("auto", w, inputs, seq).name == "cheap_cache" == explain(w, inputs, seq).executor


def test_explain_says_which_bound_and_device_made_auto_run_dense() -> None:
    """The CUDA tuning on CPU tensors (no GPU needed): a call that skips 98,304 units of work runs gathered under the
    CPU tuning (60,000) and dense under CUDA's (64,000,000); explain names the bound, its value, the device, and
    whether the size or the kept share decided."""
    from condcomp.executors.gathered import CUDA

    w = make_weights(make_layout(H=8, Dh=8, D=64), torch.float32)
    x = torch.randn(4, 512, 64)
    plan, _ = leaf_plan(seq_active([2, 2, 2, 2], 8))  # keeps 0.25: skips 0.75 * 131,072 = 98,304
    on_cpu = explain(w, AttentionInputs(x=x), plan, pool=[GatheredExecutor(tuning=CPU), get_executor("masked")])
    assert on_cpu.executor == "gathered"
    choice = explain(w, AttentionInputs(x=x), plan, pool=[GatheredExecutor(tuning=CUDA), get_executor("masked")])
    assert choice.executor == "masked"
    said = dict(choice.verdicts)["gathered"]
    assert "B*T*D = 131,072" in said and "min_skipped_work_sequence = 64,000,000" in said and "cuda" in said, said
    assert "partly or not measured" in said
    half = explain(w, AttentionInputs(x=x[:2]), leaf_plan(seq_active([2, 2], 8))[0],
                   pool=[GatheredExecutor(tuning=CPU), get_executor("masked")])  # B*T*D above 60,000, skipped below
    said = dict(half.verdicts)["gathered"]
    assert half.executor == "masked" and "skips 49,152" in said and "= 60,000 of the cpu tuning (measured)" in said
    full, _ = leaf_plan(seq_active([7, 7, 7, 7], 8))  # keeps 7/8 of the work: the share decides, not the size
    big = explain(w, AttentionInputs(x=x), full, pool=[GatheredExecutor(tuning=CPU), get_executor("masked")])
    assert "at least tuning.dense_work_sequence = 0.8" in dict(big.verdicts)["gathered"]
