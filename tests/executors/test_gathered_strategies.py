"""Every strategy of the gathered executor's dispatch table, forced by name, against the per-head reference.

Each strategy runs every case of the executor matrix (test_against_reference.CASES) of its granularity that it
supports, outputs and gradients in float64; where it declines, the reasons are sentences and forcing it raises
with them. The tuning lifts the size rules so that the toy shapes reach every strategy.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from core_helpers import TOLERANCES, run_and_grads
from test_against_reference import CASES, build_case

from condcomp.executors import grouped_gemm
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import CPU, STRATEGIES, GatheredCall, GatheredExecutor, gather_sizes, strategy_names

TOY = replace(CPU, min_set_work=0, min_grouped_copy=0)
TOKEN_CASES = [c for c in CASES if c.startswith("token")]
SEQUENCE_CASES = [c for c in CASES if not c.startswith("token")]


@pytest.mark.parametrize("strategy", strategy_names())
def test_strategy_matches_reference_on_every_case_it_supports(strategy: str) -> None:
    if strategy == "sequence.grouped" and not grouped_gemm.available(torch.zeros(1, dtype=torch.float64)):
        pytest.skip("this torch build exports no MKL cblas_?gemm_batch")
    triton = strategy in ("sequence.triton", "token.triton")
    tuning = replace(TOY, pair_kernels_on_cpu=True) if triton else TOY  # its torch fallback
    forced = GatheredExecutor(tuning=tuning, strategy=strategy)
    ran = 0
    for name in TOKEN_CASES if strategy.startswith("token") else SEQUENCE_CASES:
        case = build_case(name, torch.float64)
        call = GatheredCall(case.weights, case.inputs, case.plan,
                            gather_sizes(case.weights, case.inputs, case.plan, tuning), tuning)
        reasons = next(r for r in STRATEGIES[case.plan.granularity] if r.name == strategy).supports(call)
        if reasons:
            assert all(isinstance(r, str) and r for r in reasons)
            with pytest.raises(RuntimeError, match="cannot run this call"):
                forced(case.weights, case.inputs, case.plan)
            continue
        atol, rtol = TOLERANCES[torch.float64]
        probe = torch.randn(case.inputs.x.shape[0], case.inputs.x.shape[1], case.weights.layout.d_model,
                            dtype=torch.float64)
        y_ref, g_ref = run_and_grads(get_executor("reference"), case.weights, case.inputs, case.plan, case.leaves,
                                     probe)
        y, g = run_and_grads(forced, case.weights, case.inputs, case.plan, case.leaves, probe)
        torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{strategy} {n}: {m}")
        for leaf in case.leaves:
            torch.testing.assert_close(g[leaf], g_ref[leaf], atol=atol * 10, rtol=rtol * 10,
                                       msg=lambda m, n=name, lf=leaf: f"{strategy} {n} grad of {lf}: {m}")
        ran += 1
    assert ran >= 1, f"{strategy} ran no case"


def test_forcing_a_strategy_checks_its_name_and_granularity() -> None:
    with pytest.raises(KeyError, match="sequence.buckets"):
        GatheredExecutor(strategy="sequence.bucket")
    case = build_case("token", torch.float64)
    with pytest.raises(RuntimeError, match="runs sequence plans"):
        GatheredExecutor(strategy="sequence.buckets")(case.weights, case.inputs, case.plan)
