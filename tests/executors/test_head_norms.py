"""Per-head query/key norms (Qwen3's ``q_norm``/``k_norm``: over Dh, after the projection, before rotary).

The reference executor is checked against an independent float64 computation written here; then every executor
and every gathered strategy, forced by name, against the reference on every case of the executor matrix, with the
norms on (outputs and the norms' weight gradients). A KV cache holds keys already normalised: only freshly
projected keys go through ``k_norm``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from core_helpers import TOLERANCES, leaf_plan, make_layout, make_weights, random_active, rotary_tables, run_and_grads
from test_against_reference import CASES, build_case
from test_gathered_strategies import TOY
from torch import nn

from condcomp.executors import grouped_gemm
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import GatheredExecutor, strategy_names
from condcomp.rotary import apply_rotary
from condcomp.types import AttentionInputs


def _norm(Dh: int) -> nn.RMSNorm:
    norm = nn.RMSNorm(Dh, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not the identity, so a skipped or misplaced norm shows
    return norm


def _with_norms(case: object) -> object:
    Dh = case.weights.layout.head_dim  # type: ignore[attr-defined]
    return replace(case, weights=replace(case.weights, q_norm=_norm(Dh), k_norm=_norm(Dh)))  # type: ignore[type-var]


@pytest.mark.parametrize("granularity", ["sequence", "token"])
def test_reference_executor_equals_an_independent_computation(granularity: str) -> None:
    B, T, H, Hkv, Dh, D = 3, 5, 4, 2, 4, 16
    w = make_weights(make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D))
    qn, kn = _norm(Dh), _norm(Dh)
    w = replace(w, q_norm=qn, k_norm=kn)
    x = torch.randn(B, T, D, dtype=torch.float64)
    cos, sin = rotary_tables(B, T, Dh, torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    plan, _ = leaf_plan(random_active((B, H) if granularity == "sequence" else (B, T, H)))
    inputs = AttentionInputs(x=x, mask=mask, key_mask=mask, rotary=(cos, sin))
    got = get_executor("reference")(w, inputs, plan)
    # Independent: every head densely, then the plan's gates per head (and token), then the output projection.
    q = qn((x @ w.q_weight.T + w.q_bias).view(B, T, H, Dh)).transpose(1, 2)  # (B, H, T, Dh)
    k = kn((x @ w.k_weight.T + w.k_bias).view(B, T, Hkv, Dh)).transpose(1, 2)
    v = (x @ w.v_weight.T + w.v_bias).view(B, T, Hkv, Dh).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=Dh**-0.5)  # (B,H,T,Dh)
    g = plan.gates[:, :, None] if granularity == "sequence" else plan.gates.transpose(1, 2)  # (B, H, 1|T)
    heads = a * g.unsqueeze(-1)
    y = torch.einsum("bhtd,ohd->bto", heads, w.o_weight.view(D, H, Dh))
    active = plan.active.any(-1)[:, None] if granularity == "sequence" else plan.active.any(-1)  # (B, 1|T)
    y = y + w.o_bias * active.unsqueeze(-1)
    torch.testing.assert_close(got, y, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("executor", ["masked", "gathered", *strategy_names()])
def test_every_executor_and_strategy_applies_the_norms_like_the_reference(executor: str) -> None:
    if executor == "sequence.grouped" and not grouped_gemm.available(torch.zeros(1, dtype=torch.float64)):
        pytest.skip("this torch build exports no MKL cblas_?gemm_batch")
    tuning = (replace(TOY, pair_kernels_on_cpu=True) if executor in ("sequence.triton", "token.triton")
              else TOY)  # their torch fallback
    run = get_executor(executor) if executor in ("masked", "gathered") else GatheredExecutor(tuning=tuning,
                                                                                             strategy=executor)
    ran = 0
    for name in CASES:
        if "." in executor and name.startswith("token") != executor.startswith("token"):
            continue
        case = _with_norms(build_case(name, torch.float64))
        w, inputs, plan = case.weights, case.inputs, case.plan  # type: ignore[attr-defined]
        if "." in executor:
            from condcomp.executors.gathered import STRATEGIES, GatheredCall, gather_sizes

            call = GatheredCall(w, inputs, plan, gather_sizes(w, inputs, plan, tuning), tuning)
            if next(r for r in STRATEGIES[plan.granularity] if r.name == executor).supports(call):
                continue
        leaves = {**case.leaves, "q_norm": w.q_norm.weight, "k_norm": w.k_norm.weight}  # type: ignore[attr-defined]
        probe = torch.randn(*inputs.x.shape[:2], w.layout.d_model, dtype=torch.float64)
        y_ref, g_ref = run_and_grads(get_executor("reference"), w, inputs, plan, leaves, probe)
        y, g = run_and_grads(run, w, inputs, plan, leaves, probe)
        atol, rtol = TOLERANCES[torch.float64]
        torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{executor} {n}: {m}")
        for leaf in ("q_norm", "k_norm"):
            if g_ref[leaf] is not None:
                torch.testing.assert_close(g[leaf], g_ref[leaf], atol=atol * 10, rtol=rtol * 10,
                                           msg=lambda m, n=name, lf=leaf: f"{executor} {n} grad of {lf}: {m}")
        ran += 1
    assert ran >= 1, f"{executor} ran no case"
