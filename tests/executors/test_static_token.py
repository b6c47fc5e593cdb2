"""The gathered executor's capturable token strategies (``token.static``, ``token.triton``) and what MoH declares.

Both strategies are compared with the per-head reference executor, outputs and every gradient (x, keys/values,
weights, biases, gates, the KV cache), on MoH-shaped token plans (the first ``S`` heads chosen by every real token,
at most ``R`` routed heads per token, tokens with 0 and with ``R`` routed heads, padding tokens with none, active
heads whose gate is 0) over the executor matrix's situations: padding, causal, GQA, cross-attention, rotary,
per-head biases, a KV cache. ``token.static`` in float64; ``token.triton`` in float64 through the pair ops' torch
fallback, and in float32 through the Triton kernels when ``TRITON_INTERPRET=1`` is set (the CI step that runs the
Triton tests; the fallback is then patched to fail on float32, so nothing passes by falling back). MoH's declared
``k_cap`` is checked against a hand count of the routed heads it gives each token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from condcomp.policies.budgetformer import BudgetFormerPolicy
from condcomp.policies.fixed import FixedPolicy
from condcomp.policies.full import FullPolicy
from condcomp.routers.moh import MoHRouter, routed_counts
from core_helpers import TOLERANCES, run_and_grads
from test_against_reference import Case, build_case
from test_triton_pairs import assert_matches, leaf, output_loop, project_loop
from torch import Tensor

import condcomp
from condcomp.executors import gathered
from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import CPU, CUDA, GatheredExecutor, pairs
from condcomp.executors.gathered.pairs import fallback, ops
from condcomp.plans import plan_from_active
from condcomp.types import Budget

INTERPRETER = pairs.interpreting() and pairs.triton_available()
STATIC = replace(CPU, static_token=True)  # eager calls on CPU take the capturable token path
PAIRS = replace(CPU, static_token=True, pair_kernels_on_cpu=True)  # ... through the pair ops
SITUATIONS = ["seq_k", "padding", "causal", "causal_padding", "gqa", "gqa1", "cross", "rotary", "attn_bias",
              "kv_cache", "no_bias", "no_key_bias", "fused_qkv"]
SHAPES = [pytest.param(2, 1, id="S2R1"), pytest.param(0, 2, id="S0R2"), pytest.param(1, 3, id="S1R3")]


@pytest.fixture(autouse=True)
def _kernels_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Under the interpreter, a float32 pair op that reached the torch fallback fails the test."""
    if INTERPRETER:
        for name in ("pair_matmul", "pair_sum", "group_xty", "row_attention", "row_attention_backward"):
            original = getattr(fallback, name)

            def refuse(*args: object, _name: str = name, _orig: object = original, **kwargs: object) -> object:
                if any(isinstance(a, Tensor) and a.dtype == torch.float32 for a in args):
                    raise AssertionError(f"float32 {_name} fell back to torch under the interpreter")
                return _orig(*args, **kwargs)  # type: ignore[operator]

            monkeypatch.setattr(fallback, name, refuse)
    yield


def moh_case(name: str, S: int, R: int, dtype: torch.dtype) -> Case:
    """A matrix situation with a MoH-shaped token plan: heads ``0..S-1`` on for every real token, 0 to ``R`` routed
    heads per token (token 0 of each example: none, token 1: ``R``), padding tokens with none, and a gate of 0 on
    some active heads; declared ``shared_heads = S``, ``k_cap = S + R``."""
    case = build_case(name, dtype)
    x = case.inputs.x
    B, T = x.shape[:2]
    H = case.weights.layout.num_heads
    E = H - S
    routed_k = torch.randint(0, R + 1, (B, T))
    routed_k[:, 0], routed_k[:, 1] = 0, R
    scores = torch.rand(B, T, E)
    rank = scores.argsort(-1, descending=True).argsort(-1)
    active = torch.cat([torch.ones(B, T, S, dtype=torch.bool), rank < routed_k.unsqueeze(-1)], -1)  # (B, T, H)
    if case.inputs.mask is not None:
        active &= case.inputs.mask.bool().unsqueeze(-1)
    gates = torch.rand(B, T, H, dtype=torch.float64) + 0.5
    gates[0, 2] = 0.0  # a token whose every gate is 0 (its heads still active)
    gates[:, :, -1] = 0.0  # a routed head whose gate is always 0
    gates = gates.to(dtype).requires_grad_()
    case.plan = plan_from_active(active, gates, k_cap=S + R, shared_heads=S)
    case.leaves["gates"] = gates
    return case


def compare(executor: GatheredExecutor, case: Case, dtype: torch.dtype, strategy: str) -> None:
    assert executor.prepare(case.weights, case.inputs, case.plan).strategy == strategy
    atol, rtol = TOLERANCES[dtype]
    probe = torch.randn(*case.inputs.x.shape[:2], case.weights.layout.d_model, dtype=torch.float64).to(dtype)
    y_ref, g_ref = run_and_grads(get_executor("reference"), case.weights, case.inputs, case.plan, case.leaves, probe)
    y, g = run_and_grads(executor, case.weights, case.inputs, case.plan, case.leaves, probe)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    for name in case.leaves:
        torch.testing.assert_close(g[name], g_ref[name], atol=atol * 10, rtol=rtol * 10,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize(("S", "R"), SHAPES)
@pytest.mark.parametrize("name", SITUATIONS)
def test_token_static_matches_reference(name: str, S: int, R: int) -> None:
    compare(GatheredExecutor(tuning=STATIC), moh_case(name, S, R, torch.float64), torch.float64, "token.static")


@pytest.mark.parametrize(("S", "R"), SHAPES)
@pytest.mark.parametrize("name", SITUATIONS)
def test_token_triton_matches_reference(name: str, S: int, R: int) -> None:
    """float64: the pair ops' torch fallback (the strategy's own arithmetic around the ops)."""
    compare(GatheredExecutor(tuning=PAIRS), moh_case(name, S, R, torch.float64), torch.float64, "token.triton")


@pytest.mark.skipif(not INTERPRETER, reason="the Triton kernels run on CPU under TRITON_INTERPRET=1 only")
@pytest.mark.parametrize(("S", "R"), SHAPES[:2])
@pytest.mark.parametrize("name", ["causal_padding", "gqa", "cross", "rotary", "kv_cache", "no_bias"])
def test_token_triton_kernels_match_reference(name: str, S: int, R: int) -> None:
    """float32 through the Triton kernels (a subset of the situations: the interpreter takes seconds a case)."""
    compare(GatheredExecutor(tuning=PAIRS), moh_case(name, S, R, torch.float32), torch.float32, "token.triton")


@pytest.mark.parametrize(("S", "R"), SHAPES[:2])
@pytest.mark.parametrize("name", ["causal_padding", "gqa", "cross", "rotary", "attn_bias", "kv_cache", "no_bias"])
def test_token_triton_without_gradients_attends_only_the_pairs(name: str, S: int, R: int) -> None:
    """No gradient asked for: the pairs' rows attend alone (``pair_row_attention``: the row kernel under the
    interpreter in float32, else the op's torch fallback in float64), outputs against the reference executor."""
    dtype = torch.float32 if INTERPRETER else torch.float64
    case = moh_case(name, S, R, dtype)
    with torch.no_grad():
        want = get_executor("reference")(case.weights, case.inputs, case.plan)
        got = GatheredExecutor(tuning=PAIRS)(case.weights, case.inputs, case.plan)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def check_row_attention(masking: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        tol: float = 1e-5) -> None:
    B, T, H, Hkv, Dh, S_, R = 2, 80, 6, 3, 16, 2, 2
    E = H - S_
    q, keys, values = torch.randn(B, T, R, Dh), torch.randn(B, Hkv, T, Dh), torch.randn(B, Hkv, T, Dh)
    slot = torch.stack([torch.randperm(E)[:R] for _ in range(B * T)]).view(B, T, R)
    counts = torch.randint(0, R + 1, (B, T))
    mask = None
    if masking == "additive":
        mask = torch.randn(B, H, T, T)
        mask[0, :, 3] = float("-inf")  # a row whose every key is masked: zeros (no NaN) from the kernel
    elif masking == "bool":
        mask = torch.rand(B, 1, 1, T) > 0.3
    args = (S_, E, H // Hkv, masking == "causal", Dh**-0.5)
    on = [t if t is None else t.to(device, dtype if t.is_floating_point() else t.dtype)
          for t in (q, keys, values, mask, slot, counts)]
    got = ops.pair_row_attention(*on, *args)[0].cpu()
    want = fallback.row_attention(q.double(), keys.double(), values.double(),
                                  None if mask is None else mask.double() if mask.is_floating_point() else mask,
                                  slot, counts, *args)[0]
    if masking == "additive":
        assert not got[0, 3].any()  # the dead row: zeros, no NaN
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("masking", ["causal", "additive", "bool"])
def test_row_attention_op_over_several_key_blocks(masking: str) -> None:
    """``pair_row_attention`` on 80 keys (two key blocks of 64: the running softmax), GQA groups of 2, tokens with
    0 to R pairs, a causal flag, an additive mask with a dead row or a bool mask: against the op's dense float64
    rule (fallback.py, SDPA over a block of the routed heads), in float32 (the row kernel under the interpreter)."""
    check_row_attention(masking)


@pytest.mark.skipif(not (torch.cuda.is_available() and pairs.triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_attention_kernel_on_cuda(dtype: torch.dtype) -> None:
    for masking in ("causal", "additive", "bool"):
        check_row_attention(masking, "cuda", dtype, 1e-4 if dtype == torch.float32 else 3e-2)


def test_shared_heads_only() -> None:
    """``k_cap = shared_heads``: no routed pair; token.static computes the shared block alone and token.triton
    says why it does not run."""
    case = moh_case("causal_padding", 4, 0, torch.float64)
    compare(GatheredExecutor(tuning=PAIRS), case, torch.float64, "token.static")
    why = dict(GatheredExecutor(tuning=PAIRS).explain(case.weights, case.inputs, case.plan))["token.triton"]
    assert "no routed pair" in why[0]


@pytest.mark.parametrize("strategy", ["token.static", "token.triton"])
def test_a_token_above_its_cap_is_an_error_not_a_dropped_head(strategy: str) -> None:
    case = moh_case("padding", 1, 2, torch.float64)
    active = case.plan.active.clone()
    active[0, 1] = True  # 3 routed heads on one token, declared at most 2
    plan = plan_from_active(active, None, k_cap=3, shared_heads=1)
    with pytest.raises(RuntimeError, match="more than k_cap - shared_heads = 2 routed heads"):
        GatheredExecutor(tuning=PAIRS, strategy=strategy)(case.weights, case.inputs, plan)


def test_explain_says_when_a_token_plan_is_over_the_capturable_strategies_cap() -> None:
    # explain called token.static the strategy that runs (or could) while the call would fail on its cap
    case = moh_case("padding", 1, 2, torch.float64)
    active = case.plan.active.clone()
    active[0, 1] = True  # 3 routed heads on one token, declared at most 2
    plan = plan_from_active(active, None, k_cap=3, shared_heads=1)
    want = "a token chose 3 routed heads, more than k_cap - shared_heads = 2 (HeadPlan.k_cap = 3, shared_heads = 1)"
    for tuning in (STATIC, PAIRS, CPU):  # the static path runs it, through the pair ops, or the sized path does
        lines = dict(GatheredExecutor(tuning=tuning).explain(case.weights, case.inputs, plan))
        for name in ("token.static", "token.triton"):
            assert want in lines[name][-1] and "refuses the call" in lines[name][-1], (tuning.static_token, lines)
        assert not any(want in why for name, reasons in lines.items() if name not in ("token.static", "token.triton")
                       for why in reasons)
    assert want in str(condcomp.explain(case.weights, case.inputs, plan, executor="gathered"))
    within = dict(GatheredExecutor(tuning=STATIC).explain(case.weights, case.inputs, case.plan))
    assert "over its cap" not in str(within)


def test_the_static_token_call_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    case = moh_case("padding", 2, 1, torch.float64)

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("the static token path read the sizes back")

    monkeypatch.setattr(gathered, "gather_sizes", no_read)
    prepared = GatheredExecutor(tuning=STATIC).prepare(case.weights, case.inputs, case.plan)
    assert prepared.strategy == "token.static" and not prepared.call.sizes.read
    prepared(case.weights, case.inputs, case.plan)


def test_cpu_eager_keeps_the_sized_token_strategies_and_cuda_runs_the_static_one() -> None:
    case = moh_case("padding", 2, 1, torch.float64)
    assert not CPU.static_token and CUDA.static_token and not CUDA.pair_kernels
    assert GatheredExecutor().prepare(case.weights, case.inputs, case.plan).strategy.startswith("token.")
    assert GatheredExecutor().prepare(case.weights, case.inputs, case.plan).strategy not in ("token.static",
                                                                                            "token.triton")
    assert GatheredExecutor().static(case.plan, CUDA) == "tuning.static_token on cuda"
    assert GatheredExecutor().static(case.plan, CPU) is None


def test_explain_names_the_token_path() -> None:
    case = moh_case("padding", 2, 1, torch.float64)
    lines = dict(GatheredExecutor(tuning=STATIC).explain(case.weights, case.inputs, case.plan))
    assert "2 shared heads" in lines["token.static"][0] and "at most 1 routed" in lines["token.static"][0]
    assert "token.static runs it" in lines["token.per_head"][0]
    assert "CUDA only" in lines["token.triton"][0]
    on_cuda = dict(GatheredExecutor(tuning=CUDA).explain(case.weights, case.inputs, case.plan))
    assert "tuning.static_token on cuda" in on_cuda["token.static"][0]
    assert on_cuda["token.triton"] == ["tuning.pair_kernels is off"]


def test_explain_names_the_capturable_strategy_that_runs() -> None:
    # with the pair kernels on, token.triton ran while the sized strategies' reasons said "token.static runs it"
    case = moh_case("padding", 2, 1, torch.float32)
    executor = GatheredExecutor(tuning=PAIRS)
    assert executor.prepare(case.weights, case.inputs, case.plan).strategy == "token.triton"
    lines = dict(executor.explain(case.weights, case.inputs, case.plan))
    assert "token.triton runs it" in lines["token.per_head"][0] and "token.static runs it" not in str(lines)
    assert "only the pairs' rows" in lines["token.triton"][0]  # inference: the row kernel, not every query slot


@pytest.mark.skipif(not INTERPRETER, reason="the weight gradients' kernel runs under TRITON_INTERPRET=1")
def test_token_triton_weight_gradients_are_deterministic() -> None:
    case = moh_case("causal_padding", 1, 2, torch.float32)
    ex = GatheredExecutor(tuning=PAIRS)
    probe = torch.randn(*case.inputs.x.shape[:2], case.weights.layout.d_model)
    runs = [run_and_grads(ex, case.weights, case.inputs, case.plan, case.leaves, probe)[1] for _ in range(2)]
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def check_one_row_ops(C: int, with_bias: bool, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    n, E, D, Dh = 70, 4, 20, 8
    counts = torch.randint(0, C + 1, (n,))
    counts[0], counts[1] = 0, C
    heads = torch.stack([torch.randperm(E)[:C] for _ in range(n)])
    if C == 2:
        heads[:, 0], heads[:, 1] = 0, torch.randint(1, E, (n,))
        counts[2:] = 2
    project = {"x": leaf(n, 1, D), "weight": leaf(E, Dh, D), "heads": heads, "counts": counts}
    output = {"a": leaf(n, C, 1, Dh), "weight": leaf(D, E * Dh), "gates": (torch.rand(n, C) + 0.5).requires_grad_(),
              "heads": heads, "counts": counts}
    if with_bias:
        project["bias"], output["bias"] = leaf(E, Dh), leaf(D)

    def p_op(x: Tensor, weight: Tensor, heads: Tensor, counts: Tensor, bias: Tensor | None = None) -> Tensor:
        return ops.pair_project(x, weight, bias, heads, counts)

    def p_loop(x: Tensor, weight: Tensor, heads: Tensor, counts: Tensor, bias: Tensor | None = None) -> Tensor:
        return project_loop(x, weight, bias, heads, counts)

    def o_op(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor,
             bias: Tensor | None = None) -> Tensor:
        return ops.pair_output(a, weight, gates, heads, counts, bias)

    def o_loop(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor,
               bias: Tensor | None = None) -> Tensor:
        return output_loop(a, weight, gates, heads, counts, bias)

    assert_matches(p_op, p_loop, {k: v.to(device) for k, v in project.items()}, device, dtype)
    assert_matches(o_op, o_loop, {k: v.to(device) for k, v in output.items()}, device, dtype)


@pytest.mark.parametrize(("C", "with_bias"), [(2, True), (4, False)])
def test_one_row_pair_ops_match_the_loop(C: int, with_bias: bool) -> None:
    """The pair ops with one row per pair (``T == 1``, how token.triton calls them; under the interpreter the
    sorted-block kernels): 70 rows, head 0 in 70 pairs with C = 2 (two blocks of 64 for one head), tokens with no
    head and with C heads, odd sizes (D = 20) at tile edges; outputs and every gradient against a float64 loop."""
    check_one_row_ops(C, with_bias)


@pytest.mark.skipif(not (torch.cuda.is_available() and pairs.triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_kernels_on_cuda(dtype: torch.dtype) -> None:
    """The compiled sorted-block kernels (not the interpreter)."""
    check_one_row_ops(2, True, "cuda", dtype)
    check_one_row_ops(4, False, "cuda", dtype)


def test_token_triton_compiles_with_no_graph_break() -> None:
    """The strategy under ``fullgraph=True`` (the pair ops are opaque custom ops with fake implementations)."""
    case = moh_case("causal_padding", 1, 2, torch.float32)
    w, inputs, plan = case.weights, case.inputs, case.plan
    ex = GatheredExecutor(tuning=PAIRS)
    torch._dynamo.reset()
    y = torch.compile(lambda: ex(w, inputs, plan), backend="eager", fullgraph=True)()
    torch.testing.assert_close(y, get_executor("reference")(w, inputs, plan), atol=2e-5, rtol=1e-4)


def hand_routed(budget: Budget, H: int, hs: int, top_k: int) -> int:
    """The most routed heads any row of this budget gets, counted from its ``k`` values one by one."""
    counts = routed_counts(budget, tuple(budget.k.shape[:1]) + (1,), H, hs, top_k)  # type: ignore[arg-type]
    return max(int(c) for c in counts.reshape(-1))


@pytest.mark.parametrize(("hs", "top_k"), [(4, 2), (0, 3), (2, 1)])
def test_moh_declares_a_cap_that_bounds_its_tokens(hs: int, top_k: int) -> None:
    """MoH's plan declares ``shared_heads = h_s`` and a ``k_cap`` no token exceeds, and equal to the most heads a
    token takes under the full and fixed policies (the declared bound is reached, not loose)."""
    H, D = 8, 16
    x = torch.randn(3, 6, D)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    router = MoHRouter(D, H, shared_heads=hs, top_k=top_k).eval()
    for policy in (FullPolicy(H), FixedPolicy(H, 0.75), FixedPolicy(H, 0.25), BudgetFormerPolicy(D, H).eval()):
        budget = policy(x, mask)
        plan = router(x, mask, budget, None)
        assert plan.shared_heads == hs and plan.k_cap is not None
        assert (plan.counts <= plan.k_cap).all()
        assert plan.active[..., :hs][mask].all()  # shared heads on every real token
        if budget.k_floor is not None:  # full, fixed: every row's k known, the bound is reached
            assert plan.k_cap == hs + hand_routed(budget, H, hs, top_k)
            assert int(plan.counts.max()) == plan.k_cap


def test_moh_with_a_learned_budget_in_training_declares_every_head() -> None:
    """With a learned budget in training MoH computes every head of a real token: all of them are declared shared."""
    H, D = 8, 16
    policy, router = BudgetFormerPolicy(D, H).train(), MoHRouter(D, H, shared_heads=2, top_k=2).train()
    x = torch.randn(2, 5, D)
    plan = router(x, None, policy(x, None), None)
    assert plan.shared_heads == H and plan.k_cap == H and plan.active.all()


def test_the_moh_router_compiles_without_a_graph_break() -> None:
    """The router itself reads nothing back (a graph break would raise under fullgraph=True), load balance included."""
    H, D = 8, 16
    router = MoHRouter(D, H, shared_heads=2, top_k=3).train()
    x, mask = torch.randn(2, 5, D), torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    budget = FullPolicy(H)(x, mask)
    torch._dynamo.reset()
    plan = torch.compile(router, backend="eager", fullgraph=True)(x, mask, budget, None)
    want = router(x, mask, budget, None)
    assert torch.equal(plan.active, want.active) and plan.k_cap == want.k_cap == 5
    torch.testing.assert_close(plan.aux_losses["load_balance"], want.aux_losses["load_balance"])


def test_budget_declares_a_floor_no_higher_than_its_cap() -> None:
    with pytest.raises(ValueError, match="k_floor = 3 exceeds"):
        Budget(s=torch.ones(1), k=torch.ones(1, dtype=torch.long), k_cap=2, k_floor=3)
    with pytest.raises(ValueError, match="HeadPlan.shared_heads"):
        plan_from_active(torch.ones(1, 2, 4, dtype=torch.bool), shared_heads=5)
    assert condcomp.Budget is Budget


@pytest.mark.parametrize("strategy", ["token.static", "token.triton"])
@pytest.mark.parametrize(("B", "T"), [(0, 5), (2, 0)])
def test_empty_batches_and_sequences(strategy: str, B: int, T: int) -> None:
    case = build_case("causal", torch.float64)
    x = torch.randn(B, T, case.weights.layout.d_model, dtype=torch.float64, requires_grad=True)
    active = torch.zeros(B, T, case.weights.layout.num_heads, dtype=torch.bool)
    plan = plan_from_active(active, active.double(), k_cap=2, shared_heads=1)
    y = GatheredExecutor(tuning=PAIRS, strategy=strategy)(case.weights, replace(case.inputs, x=x), plan)
    assert y.shape == (B, T, case.weights.layout.d_model)
    y.sum().backward()


def test_row_attention_op_registration_and_capture() -> None:
    """``torch.library.opcheck`` (schema, fake tensor, dispatch) on the row-attention op, and token.triton without
    gradients (the op in the graph) under ``fullgraph=True``."""
    B, T, Dh = 2, 5, 8
    q, kv = torch.randn(B, T, 2, Dh), torch.randn(B, 4, T, Dh)
    slot, counts = torch.tensor([0, 1]).expand(B, T, 2).contiguous(), torch.ones(B, T, dtype=torch.long)
    torch.library.opcheck(ops.pair_row_attention, (q, kv, kv.clone(), None, slot, counts, 1, 3, 1, True, 0.5))
    case = moh_case("causal_padding", 1, 2, torch.float32)
    w, inputs, plan = case.weights, case.inputs, case.plan
    ex = GatheredExecutor(tuning=PAIRS)
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(lambda: ex(w, inputs, plan), backend="eager", fullgraph=True)()
        torch.testing.assert_close(y, get_executor("reference")(w, inputs, plan), atol=2e-5, rtol=1e-4)
