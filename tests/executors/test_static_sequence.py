"""``sequence.static``, the gathered executor's capturable sequence strategy, and the ``k_cap`` it is sized by.

The strategy is compared with the per-head reference executor (outputs and every gradient, float64) on every
sequence case of the executor matrix, with plans whose ``k_cap`` is below H (so heads are padded with gate 0) and
without one (H). The policies' declared caps are checked against the tensor budget rule, value by value.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from condcomp.policies.budgetformer import BudgetFormerPolicy
from condcomp.policies.fixed import FixedPolicy
from condcomp.policies.full import FullPolicy
from condcomp.routers.topk import TopKRouter
from core_helpers import TOLERANCES, leaf_plan, random_active, run_and_grads
from test_against_reference import CASES, build_case

import condcomp
from condcomp.executors import gathered
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import CPU, CUDA, GatheredExecutor
from condcomp.plans import budget_k, budget_k_bound, plan_from_active
from condcomp.types import Budget, HeadPlan

SEQUENCE_CASES = [c for c in CASES if not c.startswith("token")]
STATIC = replace(CPU, static_sequence=True)  # eager calls on CPU take the capturable path too


def capped(case_name: str, cap: int) -> tuple[object, object]:
    """A matrix case whose plan keeps 0, 1, cap and cap heads per example, declared ``k_cap = cap``."""
    case = build_case(case_name, torch.float64)
    H = case.weights.layout.num_heads
    ks = torch.tensor([0, min(1, cap), cap, cap])
    plan, gates = leaf_plan(random_active((4, H), ks), torch.float64)
    case.plan, case.leaves["gates"] = replace(plan, k_cap=cap), gates
    return case, get_executor("reference")


@pytest.mark.parametrize("cap", [1, 2, None])
@pytest.mark.parametrize("case_name", SEQUENCE_CASES)
def test_static_matches_reference(case_name: str, cap: int | None) -> None:
    case, reference = capped(case_name, cap if cap is not None else 4)
    if cap is None:
        case.plan = replace(case.plan, k_cap=None)
    static = GatheredExecutor(tuning=STATIC)
    assert static.prepare(case.weights, case.inputs, case.plan).strategy == "sequence.static"
    atol, rtol = TOLERANCES[torch.float64]
    probe = torch.randn(case.inputs.x.shape[0], case.inputs.x.shape[1], case.weights.layout.d_model,
                        dtype=torch.float64)
    y_ref, g_ref = run_and_grads(reference, case.weights, case.inputs, case.plan, case.leaves, probe)
    y, g = run_and_grads(static, case.weights, case.inputs, case.plan, case.leaves, probe)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    assert (y[0] == 0).all(), "a k = 0 example must give exactly zero (no output bias)"
    for name in case.leaves:
        torch.testing.assert_close(g[name], g_ref[name], atol=atol * 10, rtol=rtol * 10,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


def test_static_with_a_larger_head_count_and_variable_k() -> None:
    """H = 8, cap 5: rows of 0, 3, 5 and 2 heads; the padded heads change nothing."""
    from core_helpers import make_layout, make_weights, weight_leaves

    layout = make_layout(H=8, Hkv=4, Dh=4, D=32, causal=True)
    w = make_weights(layout, torch.float64, bias=True)
    x = torch.randn(4, 6, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    inputs = condcomp.AttentionInputs(x=x, mask=mask, key_mask=mask)
    plan, gates = leaf_plan(random_active((4, 8), torch.tensor([0, 3, 5, 2])), torch.float64)
    plan = replace(plan, k_cap=5)
    leaves = {"x": x, "gates": gates, **weight_leaves(w)}
    probe = torch.randn(4, 6, 32, dtype=torch.float64)
    y_ref, g_ref = run_and_grads(get_executor("reference"), w, inputs, plan, leaves, probe)
    y, g = run_and_grads(GatheredExecutor(strategy="sequence.static"), w, inputs, plan, leaves, probe)
    torch.testing.assert_close(y, y_ref)
    for name in leaves:
        torch.testing.assert_close(g[name], g_ref[name], msg=lambda m, n=name: f"grad of {n}: {m}")


def test_a_plan_above_its_cap_is_an_error_not_a_dropped_head() -> None:
    case = build_case("seq_k", torch.float64)  # counts 0, 1, 4, 2
    plan = replace(case.plan, k_cap=2)
    with pytest.raises(RuntimeError, match="more heads than its k_cap = 2"):
        GatheredExecutor(tuning=STATIC)(case.weights, case.inputs, plan)


def test_k_cap_is_checked_against_the_head_count() -> None:
    active = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"k_cap must be an int in \[0, H=4\]"):
        plan_from_active(active, k_cap=5)
    with pytest.raises(ValueError, match="non-negative int"):
        Budget(s=torch.ones(2), k=torch.ones(2, dtype=torch.long), k_cap=-1)
    assert plan_from_active(active).head_cap == 4 and plan_from_active(active, k_cap=4).head_cap == 4


def test_the_static_call_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    case, _ = capped("padding", 2)

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("the static path read the sizes back")

    monkeypatch.setattr(gathered, "gather_sizes", no_read)
    prepared = GatheredExecutor(tuning=STATIC).prepare(case.weights, case.inputs, case.plan)
    assert prepared.strategy == "sequence.static" and not prepared.call.sizes.read
    assert prepared.call.sizes.work_fraction == 0.5  # k_cap 2 of 4 heads, whatever the plan selects
    prepared(case.weights, case.inputs, case.plan)


def test_cpu_eager_keeps_the_sized_strategies_and_cuda_runs_the_static_one() -> None:
    case, _ = capped("padding", 2)
    assert not CPU.static_sequence and CUDA.static_sequence and not CUDA.measured
    ex = GatheredExecutor()
    assert ex.prepare(case.weights, case.inputs, case.plan).strategy != "sequence.static"
    assert ex.static(case.plan, CUDA) == "tuning.static_sequence on cuda"
    assert ex.static(case.plan, CPU) is None


def test_explain_names_the_static_path_and_its_padding() -> None:
    case, _ = capped("padding", 2)
    lines = dict(GatheredExecutor(tuning=STATIC).explain(case.weights, case.inputs, case.plan))
    assert "k_cap = 2 of 4 heads" in lines["sequence.static"][0]
    assert "reads nothing" in lines["sequence.buckets"][0]
    uncapped = dict(GatheredExecutor(tuning=STATIC).explain(case.weights, case.inputs, replace(case.plan, k_cap=None)))
    assert "dense cost" in uncapped["sequence.static"][0]
    on_cuda = dict(GatheredExecutor(tuning=CUDA).explain(case.weights, case.inputs, case.plan))["sequence.static"][0]
    assert "tuning.static_sequence on cuda" in on_cuda and "tuning.measured = False" in on_cuda
    choice = condcomp.explain(case.weights, case.inputs, case.plan, executor="gathered")
    assert choice.strategy != "sequence.static"  # CPU eager: the sized strategies


def test_explain_says_when_a_sequence_plan_is_over_its_cap() -> None:
    case, _ = capped("padding", 2)  # examples with 0, 1, 2 and 2 heads of 4
    over = replace(case.plan, k_cap=1)
    want = "an example chose 2 heads, more than its k_cap = 1"
    lines = dict(GatheredExecutor(tuning=STATIC).explain(case.weights, case.inputs, over))
    assert want in lines["sequence.static"][-1] and "refuses the call" in lines["sequence.static"][-1]
    assert want in lines["sequence.triton"][-1] and want not in str(lines["sequence.buckets"])
    assert "over its cap" not in str(GatheredExecutor(tuning=STATIC).explain(case.weights, case.inputs, case.plan))


def test_auto_estimate_of_a_static_call_is_the_padded_share() -> None:
    case, _ = capped("padding", 2)
    tuning = replace(STATIC, min_skipped_work_sequence=0)
    e = GatheredExecutor(tuning=tuning).estimate(case.weights, case.inputs, case.plan)
    assert e.cost == 0.5 and "k_cap = 2 of 4" in e.note  # the cap, not the plan's mean k (0.375)
    dense = GatheredExecutor(tuning=tuning).estimate(case.weights, case.inputs, replace(case.plan, k_cap=None))
    assert dense.cost > 1.0  # padded to H: dense attention is faster


@pytest.mark.parametrize("rounding", ["floor", "ceil", "round"])
@pytest.mark.parametrize("k_min", [0, 1])
def test_the_host_budget_rule_equals_the_tensor_rule(rounding: str, k_min: int) -> None:
    for H in (1, 3, 8, 10, 12, 32, 56, 112):
        for s in [i / 200 for i in range(201)] + [0.085, 0.3, 31 / 56, 1 / 3, 2 / 3, float("nan")]:
            want = int(budget_k(torch.tensor([s]), H, k_min, rounding)[0])  # type: ignore[arg-type]
            assert budget_k_bound(s, H, k_min, rounding) == want, (s, H)  # type: ignore[arg-type]


def test_policies_declare_their_cap() -> None:
    x = torch.randn(3, 5, 16)
    b = FixedPolicy(num_heads=8, fraction=0.3)(x, None)
    assert b.k_cap == 2 and b.k.tolist() == [2, 2, 2]
    assert FullPolicy(num_heads=8)(x, None).k_cap == 8
    free = BudgetFormerPolicy(d_model=16, num_heads=8)
    assert free(x, None).k_cap == 8


def test_budgetformer_cap_at_s_max_clamps_k_and_nothing_else() -> None:
    capped_policy = BudgetFormerPolicy(d_model=16, num_heads=8, s_max=0.5, cap_at_s_max=True)
    free = BudgetFormerPolicy(d_model=16, num_heads=8, s_max=0.5)
    s = torch.tensor([0.05, 0.3, 0.5, 0.74, 0.99])
    x = torch.randn(5, 3, 16)
    b, f = capped_policy.budget_of(s, x, None), free.budget_of(s, x, None)
    assert b.k_cap == 4 and f.k_cap == 8
    assert f.k.tolist() == [1, 2, 4, 5, 7]  # floor(s * 8), at least 1
    assert b.k.tolist() == [1, 2, 4, 4, 4]
    torch.testing.assert_close(b.aux_losses["budget"], f.aux_losses["budget"])


def test_topk_router_carries_the_cap_at_inference_only() -> None:
    x = torch.randn(3, 5, 16)
    budget = Budget(s=torch.full((3,), 0.25), k=torch.full((3,), 2), k_cap=2)
    router = TopKRouter(d_model=16, num_heads=8).eval()
    assert router(x, None, budget, None).k_cap == 2
    router.train()
    plan: HeadPlan = router(x, None, budget, None)
    assert plan.k_cap is None and plan.counts.tolist() == [8, 8, 8]  # training computes every head
    grouped = TopKRouter(d_model=16, num_heads=8, kv_groups=True, num_kv_heads=4).eval()
    odd = Budget(s=torch.full((3,), 0.375), k=torch.full((3,), 3), k_cap=3)
    plan = grouped(x, None, odd, None)
    assert plan.k_cap == 4 and plan.counts.tolist() == [4, 4, 4]  # ceil(3 / 2) groups of 2 heads


def test_condcomp_budget_declares_its_fraction_as_the_cap() -> None:
    model = torch.nn.Sequential(condcomp.HeadAttention(16, 8))
    condcomp.apply_(model, condcomp.CondCompConfig(policy="budgetformer", router="topk", executor="gathered"))
    model.eval()
    with condcomp.budget(model, 0.25):
        model(torch.randn(2, 5, 16))
    assert model[0].last is not None and model[0].last.plan.k_cap == 2


def test_a_budget_sweep_recompiles_with_each_fractions_cap() -> None:
    """``condcomp.budget`` at 0.5, 0.25 and 1.0 around one ``torch.compile(fullgraph=True)`` model: the second
    fraction failed ("torch.* op returned non-Tensor": the changed fraction traced as a symbol that the cap's host
    rounding cannot take). Each block now declares its cap as a host int, recompiles with it, and equals the reference
    executor at the same budget; after the blocks the policy's own budget is back."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(condcomp.HeadAttention(16, 8)).eval()
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="topk", executor="gathered"))
    reference = copy.deepcopy(model)
    reference[0].executor = "reference"
    x = torch.randn(3, 5, 16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for fraction, k in ((0.5, 4), (0.25, 2), (1.0, 8)):
        with condcomp.budget(model, fraction), condcomp.budget(reference, fraction):
            y, want = compiled(x), reference(x)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        plan = model[0].last.plan
        assert plan.k_cap == k and plan.counts.tolist() == [k] * 3
    assert model[0].budget_fraction is None and model[0].budget_cap is None
    compiled(x)
    assert model[0].last.plan.counts.tolist() == [8] * 3
