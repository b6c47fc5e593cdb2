"""The pair ops (``torch.ops.condcomp.pair_project`` / ``pair_output``) against a per-(example, head) float64 loop,
and the ``sequence.triton`` strategy built on them against the reference executor.

Outputs and every gradient (x, weight, bias; a, weight, gates, bias) on plans with a row of count 0 and a row with
every head, with the cap ``C`` below and equal to the number of heads, on a strided weight view, and on a fused
q/k/v width. Plain runs exercise the torch fallback; with ``TRITON_INTERPRET=1`` in the environment before the
process starts (the CI step ``.ci/run`` adds) the same tests run the Triton kernels on CPU in float32, and the
fallback is patched to fail so that nothing passes by falling back. ``opcheck`` checks the registrations (schema,
fake tensors, autograd), and ``torch.compile(fullgraph=True)`` captures both ops with their backward. On a machine
with CUDA, ``test_kernels_on_cuda`` runs the compiled kernels in float32, bfloat16 and float16.

The strategy runs every sequence case of the executor matrix (test_against_reference.CASES: padding, causal,
GQA, cross-attention, rotary, per-head biases, a KV cache, k = 0 and k = H rows) in float32, forced on CPU with
``GatheredTuning.pair_kernels_on_cpu``, outputs and gradients against the reference executor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from core_helpers import TOLERANCES, leaf_plan, run_and_grads, seq_active
from test_against_reference import CASES, build_case
from torch import Tensor

from condcomp.executors.auto import get_executor
from condcomp.executors.gathered import CPU, GatheredCall, GatheredExecutor, gather_sizes, get_strategy, pairs
from condcomp.executors.gathered.pairs import fallback, ops

INTERPRETER = pairs.interpreting() and pairs.triton_available()
B, T, D, E, Dh = 3, 16, 32, 4, 8
ATOL, RTOL = 1e-4, 1e-4  # float32 against the float64 loop


@pytest.fixture(autouse=True)
def _kernels_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Under the interpreter, a float32 call that reached the torch fallback fails the test."""
    if INTERPRETER:
        for name in ("pair_matmul", "pair_sum", "group_xty"):
            def refuse(*args: object, _name: str = name, **kwargs: object) -> None:
                if any(isinstance(a, Tensor) and a.dtype == torch.float32 for a in args):
                    raise AssertionError(f"float32 {_name} fell back to torch under the interpreter")
                return getattr(fallback, f"_orig_{_name}")(*args, **kwargs)

            monkeypatch.setattr(fallback, f"_orig_{name}", getattr(fallback, name), raising=False)
            monkeypatch.setattr(fallback, name, refuse)
    yield


def plan(counts: list[int], C: int) -> tuple[Tensor, Tensor]:
    """``heads (B, C)``: each row a random order of distinct heads; ``counts (B,)``."""
    heads = torch.stack([torch.randperm(E)[:C] for _ in counts])
    return heads, torch.tensor(counts)


def project_loop(x: Tensor, w: Tensor, bias: Tensor | None, heads: Tensor, counts: Tensor) -> Tensor:
    out = x.new_zeros(x.shape[0], heads.shape[1], x.shape[1], w.shape[1])
    for b in range(x.shape[0]):
        for j in range(int(counts[b])):
            h = int(heads[b, j])
            out[b, j] = x[b] @ w[h].T + (0 if bias is None else bias[h])
    return out


def output_loop(a: Tensor, wo: Tensor, gates: Tensor, heads: Tensor, counts: Tensor, bias: Tensor | None) -> Tensor:
    Dh_ = a.shape[3]
    y = a.new_zeros(a.shape[0], a.shape[2], wo.shape[0])
    for b in range(a.shape[0]):
        for j in range(int(counts[b])):
            h = int(heads[b, j])
            y[b] = y[b] + gates[b, j] * a[b, j] @ wo[:, h * Dh_:(h + 1) * Dh_].T
        if bias is not None and int(counts[b]) > 0:
            y[b] = y[b] + bias
    return y


def grads(fn, inputs: dict[str, Tensor], probe: Tensor) -> tuple[Tensor, dict[str, Tensor]]:  # type: ignore[no-untyped-def]
    y = fn(**inputs)
    leaves = {k: v for k, v in inputs.items() if v.requires_grad}
    g = torch.autograd.grad((y * probe).sum(), list(leaves.values()))
    return y.detach(), dict(zip(leaves, g))


def leaf(*shape: int) -> Tensor:
    return torch.randn(*shape).requires_grad_()


def as64(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: (v.detach().cpu().double().requires_grad_() if v.is_floating_point() else v.cpu())
            for k, v in inputs.items()}


def moved(inputs: dict[str, Tensor], device: str, dtype: torch.dtype) -> dict[str, Tensor]:
    """Fresh leaves of ``dtype`` on ``device`` (integer tensors only moved)."""
    return {k: (v.detach().to(device, dtype).requires_grad_(v.requires_grad) if v.is_floating_point() else v.to(device))
            for k, v in inputs.items()}


def assert_matches(fn, loop, inputs: dict[str, Tensor], device: str = "cpu",  # type: ignore[no-untyped-def]
                   dtype: torch.dtype = torch.float32) -> None:
    """Op vs loop: outputs and the gradient of every floating-point input. The loop runs in float64 on the op's
    inputs as they are (rounded to ``dtype``), so only the op's arithmetic differs: float32 within (1e-4, 1e-4),
    half precision within 2 % of each tensor's norm."""
    inputs = moved(inputs, device, dtype)
    probe = torch.randn(loop(**as64(inputs)).shape, dtype=torch.float64)
    y_ref, g_ref = grads(loop, as64(inputs), probe)
    y, g = grads(fn, inputs, probe.to(device, dtype))
    assert y.dtype == dtype and y.device.type == device
    assert set(g) == set(g_ref) and len(g) >= 2
    for name, got, want in [("output", y, y_ref), *((n, g[n], g_ref[n]) for n in g)]:
        got = got.cpu().double()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert (got - want).norm() <= 0.02 * want.norm() + 1e-6, f"{name}: {(got - want).norm() / want.norm()}"


CAPS = [pytest.param(E, [0, 2, E], id="C=E"), pytest.param(2, [0, 1, 2], id="C<E")]


@pytest.mark.parametrize(("C", "counts"), CAPS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_pair_project_matches_the_loop(C: int, counts: list[int], with_bias: bool) -> None:
    heads, cnt = plan(counts, C)
    inputs = {"x": leaf(B, T, D), "weight": leaf(E, Dh, D), "heads": heads, "counts": cnt}
    if with_bias:
        inputs["bias"] = leaf(E, Dh)

    def op(x: Tensor, weight: Tensor, heads: Tensor, counts: Tensor, bias: Tensor | None = None) -> Tensor:
        return ops.pair_project(x, weight, bias, heads, counts)

    def loop(x: Tensor, weight: Tensor, heads: Tensor, counts: Tensor, bias: Tensor | None = None) -> Tensor:
        return project_loop(x, weight, bias, heads, counts)

    assert_matches(op, loop, inputs)
    y = op(**{k: v.detach() for k, v in inputs.items()})
    assert torch.equal(y[0], torch.zeros_like(y[0]))  # count 0: exact zeros, no bias


def test_pair_project_reads_a_strided_weight_in_place_and_a_fused_width() -> None:
    """A transposed view ``(E, 3*Dh, D)`` of a ``(E, D, 3*Dh)`` tensor, and odd sizes (T = 5, D = 20): the masks
    at tile edges."""
    heads, cnt = plan([1, 4, 3], E)
    base = leaf(E, 20, 3 * Dh)
    inputs = {"x": leaf(B, 5, 20), "base": base, "bias": leaf(E, 3 * Dh), "heads": heads, "counts": cnt}

    def op(x: Tensor, base: Tensor, bias: Tensor, heads: Tensor, counts: Tensor) -> Tensor:
        return ops.pair_project(x, base.transpose(1, 2), bias, heads, counts)

    def loop(x: Tensor, base: Tensor, bias: Tensor, heads: Tensor, counts: Tensor) -> Tensor:
        return project_loop(x, base.transpose(1, 2), bias, heads, counts)

    assert_matches(op, loop, inputs)


@pytest.mark.parametrize(("C", "counts"), CAPS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_pair_output_matches_the_loop(C: int, counts: list[int], with_bias: bool) -> None:
    heads, cnt = plan(counts, C)
    inputs = {"a": leaf(B, C, T, Dh), "weight": leaf(D, E * Dh), "gates": (torch.rand(B, C) + 0.5).requires_grad_(),
              "heads": heads, "counts": cnt}
    if with_bias:
        inputs["bias"] = leaf(D)

    def op(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor,
           bias: Tensor | None = None) -> Tensor:
        return ops.pair_output(a, weight, gates, heads, counts, bias)

    def loop(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor,
             bias: Tensor | None = None) -> Tensor:
        return output_loop(a, weight, gates, heads, counts, bias)

    assert_matches(op, loop, inputs)
    y = op(**{k: v.detach() for k, v in inputs.items()})
    assert torch.equal(y[0], torch.zeros_like(y[0]))  # count 0: exact zeros, no bias


def test_gradients_of_only_some_inputs() -> None:
    """A frozen weight (LoRA-style) or a frozen input: only the gradients asked for, equal to the loop's."""
    heads, cnt = plan([0, 2, E], E)
    x, w, a, wo = torch.randn(B, T, D), leaf(E, Dh, D), leaf(B, E, T, Dh), torch.randn(D, E * Dh)
    gates = torch.rand(B, E) + 0.5
    (gw,) = torch.autograd.grad(ops.pair_project(x, w, None, heads, cnt).sum(), [w])
    w64 = w.detach().double().requires_grad_()
    (gw_ref,) = torch.autograd.grad(project_loop(x.double(), w64, None, heads, cnt).sum(), [w64])
    torch.testing.assert_close(gw.double(), gw_ref, atol=ATOL, rtol=RTOL)
    (ga,) = torch.autograd.grad(ops.pair_output(a, wo, gates, heads, cnt, None).sum(), [a])
    a64 = a.detach().double().requires_grad_()
    (ga_ref,) = torch.autograd.grad(output_loop(a64, wo.double(), gates.double(), heads, cnt, None).sum(), [a64])
    torch.testing.assert_close(ga.double(), ga_ref, atol=ATOL, rtol=RTOL)


def test_weight_gradients_are_deterministic() -> None:
    heads, cnt = plan([3, 2, E], E)
    x, w, b = leaf(B, T, D), leaf(E, Dh, D), leaf(E, Dh)
    probe = torch.randn(B, E, T, Dh)
    runs = [torch.autograd.grad((ops.pair_project(x, w, b, heads, cnt) * probe).sum(), [w, b]) for _ in range(2)]
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_wrong_inputs_are_named() -> None:
    heads, cnt = plan([1, 2, 3], E)
    x, w = torch.randn(B, T, D), torch.randn(E, Dh, D)
    with pytest.raises(TypeError, match="int64"):
        ops.pair_project(x, w, None, heads.int(), cnt)
    with pytest.raises(ValueError, match=r"weight \(E, F, D\)"):
        ops.pair_project(x, w.transpose(1, 2), None, heads, cnt)
    with pytest.raises(TypeError, match="dtype"):
        ops.pair_project(x, w.double(), None, heads, cnt)
    with pytest.raises(ValueError, match="gates"):
        ops.pair_output(torch.randn(B, E, T, Dh), torch.randn(D, E * Dh), torch.rand(B, 2), heads, cnt, None)


@pytest.fixture
def fp32_precision() -> Iterator[object]:
    """torch's float32 matmul precision, set through the new API (torch 2.9+) and put back after the test."""
    matmul = torch.backends.cuda.matmul
    try:
        before = matmul.fp32_precision
    except AttributeError:
        pytest.skip("this torch has no torch.backends.cuda.matmul.fp32_precision (before 2.9)")
    yield matmul
    matmul.fp32_precision = before


def test_tf32_set_through_the_new_api_is_read_not_raised(fp32_precision: object) -> None:
    """``fp32_precision = "tf32"`` (torch's recommended API) makes reading the legacy ``allow_tf32`` raise: the
    kernels' precision follows it instead (TF32 products where torch's matmul uses them), and a float32 call runs."""
    pytest.importorskip("triton")
    from condcomp.executors.gathered.pairs import tiles

    fp32_precision.fp32_precision = "tf32"  # type: ignore[attr-defined]
    assert pairs.tf32_matmul() and tiles.precision(torch.float32) is None
    assert tiles.precision(torch.bfloat16) is None
    heads, cnt = plan([1, 2, 3], E)
    x, w = torch.randn(B, T, D), torch.randn(E, Dh, D)
    torch.testing.assert_close(ops.pair_project(x, w, None, heads, cnt), project_loop(x, w, None, heads, cnt),
                               atol=1e-2, rtol=1e-2)  # TF32 tolerance (the interpreter multiplies in IEEE anyway)
    fp32_precision.fp32_precision = "ieee"  # type: ignore[attr-defined]
    assert not pairs.tf32_matmul() and tiles.precision(torch.float32) == "ieee"


def opcheck_args() -> list[tuple[object, tuple]]:
    heads, cnt = plan([0, 2, E], E)
    project = (leaf(B, T, D), leaf(E, Dh, D), leaf(E, Dh), heads, cnt)
    output = (leaf(B, E, T, Dh), leaf(D, E * Dh), (torch.rand(B, E) + 0.5).requires_grad_(), heads, cnt, leaf(D))
    return [(torch.ops.condcomp.pair_project.default, project), (torch.ops.condcomp.pair_output.default, output),
            (torch.ops.condcomp.pair_project_backward.default,
             (torch.randn(B, E, T, Dh), torch.randn(B, T, D), torch.randn(E, Dh, D), heads, cnt, True, True, True)),
            (torch.ops.condcomp.pair_output_backward.default,
             (torch.randn(B, T, D), torch.randn(B, E, T, Dh), torch.randn(D, E * Dh), torch.rand(B, E), heads, cnt,
              True, True, True, True))]


@pytest.mark.parametrize("index", range(4), ids=["pair_project", "pair_output", "project_bwd", "output_bwd"])
def test_opcheck(index: int) -> None:
    op, args = opcheck_args()[index]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_captures_both_ops_without_graph_breaks(backend: str) -> None:
    """``fullgraph=True`` fails on any graph break; ``aot_eager`` also traces the backward through the fakes."""
    heads, cnt = plan([0, 2, E], E)
    x, w, wo, gates = leaf(B, T, D), leaf(E, Dh, D), leaf(D, E * Dh), (torch.rand(B, E) + 0.5).requires_grad_()

    def layer(x: Tensor, w: Tensor, wo: Tensor, gates: Tensor) -> Tensor:
        return ops.pair_output(torch.tanh(ops.pair_project(x, w, None, heads, cnt)), wo, gates, heads, cnt, None)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    y = compiled(x, w, wo, gates)
    y_eager = layer(x, w, wo, gates)
    torch.testing.assert_close(y, y_eager, atol=0, rtol=0)
    g = torch.autograd.grad(y.sum(), [x, w, wo, gates])
    g_eager = torch.autograd.grad(y_eager.sum(), [x, w, wo, gates])
    for p, q in zip(g, g_eager):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(not pairs.interpreting(), reason="needs TRITON_INTERPRET=1 set before the process starts")
def test_the_kernels_run_under_the_interpreter() -> None:
    """With the interpreter asked for, triton must be there (the CI step installs the gpu extra): else every test
    above would pass on the torch fallback alone."""
    assert pairs.triton_available(), "TRITON_INTERPRET is set but triton is missing: pip install -e '.[gpu]'"
    assert pairs.kernel_runs(torch.zeros(1))
    assert not pairs.kernel_runs(torch.zeros(1, dtype=torch.float64))  # the interpreter runs float32 only here


ON_CPU = replace(CPU, pair_kernels_on_cpu=True, static_sequence=True)  # calls sized without a read
SEQUENCE_CASES = [c for c in CASES if not c.startswith("token")]


@pytest.mark.parametrize("case_name", SEQUENCE_CASES)
def test_sequence_triton_matches_the_reference_executor(case_name: str) -> None:
    case = build_case(case_name, torch.float32)
    forced = GatheredExecutor(tuning=ON_CPU, strategy="sequence.triton")
    atol, rtol = TOLERANCES[torch.float32]
    probe = torch.randn(case.inputs.x.shape[0], case.inputs.x.shape[1], case.weights.layout.d_model)
    y_ref, g_ref = run_and_grads(get_executor("reference"), case.weights, case.inputs, case.plan, case.leaves, probe)
    y, g = run_and_grads(forced, case.weights, case.inputs, case.plan, case.leaves, probe)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    for name in case.leaves:
        torch.testing.assert_close(g[name], g_ref[name], atol=atol * 10, rtol=rtol * 10,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


def test_sequence_triton_says_why_it_does_not_run_on_cpu() -> None:
    """Default tuning on CPU: ``explain`` names the device and the override; with the override (and calls sized
    without a host read) it is chosen before ``sequence.static``; ``pair_kernels=False`` turns it off."""
    case = build_case("seq_k", torch.float32)
    why = dict(GatheredExecutor().explain(case.weights, case.inputs, case.plan))["sequence.triton"]
    assert why and "CUDA only" in why[0] and "pair_kernels_on_cpu" in why[0]
    chosen = GatheredExecutor(tuning=ON_CPU).prepare(case.weights, case.inputs, case.plan).strategy
    assert chosen == "sequence.triton"
    off = replace(ON_CPU, pair_kernels=False)  # the switch that turns it off on CUDA too
    assert dict(GatheredExecutor(tuning=off).explain(case.weights, case.inputs, case.plan))["sequence.triton"] == [
        "tuning.pair_kernels is off"]


def test_sequence_triton_compiles_with_no_graph_break() -> None:
    """The strategy's run on a sized call: ``fullgraph=True`` fails on any host read or data-dependent shape."""
    case = build_case("causal_padding", torch.float32)
    w, inputs, plan = case.weights, case.inputs, case.plan
    call = GatheredCall(w, inputs, plan, gather_sizes(w, inputs, plan, ON_CPU), ON_CPU)
    strategy = get_strategy("sequence.triton")
    torch._dynamo.reset()
    y = torch.compile(lambda: strategy.run(call), backend="eager", fullgraph=True)()
    torch.testing.assert_close(y, get_executor("reference")(w, inputs, plan), atol=2e-5, rtol=1e-4)


class Capped(type(get_strategy("sequence.triton"))):  # type: ignore[misc]
    """The strategy with a declared cap below H."""

    def __init__(self, C: int) -> None:
        self.C = C

    def cap(self, call: GatheredCall) -> int:
        return self.C


def test_sequence_triton_with_a_cap_below_h() -> None:
    """Examples with 0, 1, 3 and 2 of 4 heads: a cap of 3 gives the reference's output; a cap of 2 fails on the
    cap check (an example chose more), never silently dropping a head; ``fullgraph=True`` captures the check."""
    case = build_case("padding", torch.float32)
    w, inputs = case.weights, case.inputs
    plan, _ = leaf_plan(seq_active([0, 1, 3, 2], 4), torch.float32)
    call = GatheredCall(w, inputs, plan, gather_sizes(w, inputs, plan, ON_CPU), ON_CPU)
    y_ref = get_executor("reference")(w, inputs, plan)
    torch.testing.assert_close(Capped(3).run(call), y_ref, atol=2e-5, rtol=1e-4)
    torch._dynamo.reset()  # the device check traces too: no graph break
    torch.testing.assert_close(torch.compile(lambda: Capped(3).run(call), backend="eager", fullgraph=True)(), y_ref,
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"an example chose 3 heads, over the cap of 2 head slots .* Capped.cap\(\)"):
        Capped(2).run(call)


def test_sequence_triton_over_its_cap_names_the_k_the_cap_its_source_and_what_to_do() -> None:
    """A plan declaring k_cap = 2 whose examples chose 0, 1, 3 and 2 of 4 heads: the error names the k (3), the cap
    and where it comes from, and the ways out; under compile (no host read) the device check says the same but k."""
    from condcomp.types import HeadPlan

    case = build_case("padding", torch.float32)
    w, inputs = case.weights, case.inputs
    built, _ = leaf_plan(seq_active([0, 1, 3, 2], 4), torch.float32)
    plan = HeadPlan("sequence", built.gates, built.active, built.counts, built.order, {}, 2)
    call = GatheredCall(w, inputs, plan, gather_sizes(w, inputs, plan, ON_CPU), ON_CPU)
    strategy = get_strategy("sequence.triton")
    with pytest.raises(ValueError) as got:
        strategy.run(call)
    msg = str(got.value)
    assert "an example chose 3 heads, over the cap of 2 head slots" in msg
    assert "the plan's k_cap = 2" in msg and "budget policy declared" in msg
    assert "cap_at_s_max=True" in msg and 'strategy="sequence.buckets"' in msg
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"chose more heads, over the cap of 2 .* the plan's k_cap = 2"):
        torch.compile(lambda: strategy.run(call), backend="eager", fullgraph=True)()


@pytest.mark.skipif(not (torch.cuda.is_available() and pairs.triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("C", "counts"), CAPS)
def test_kernels_on_cuda(dtype: torch.dtype, C: int, counts: list[int]) -> None:
    """The compiled kernels (not the interpreter) on sizes spanning several tiles: T = 80, D = 96, Dh = 16."""
    assert pairs.kernel_runs(torch.zeros(1, device="cuda", dtype=dtype))
    heads, cnt = plan(counts, C)
    project = {"x": leaf(B, 80, 96), "weight": leaf(E, 16, 96), "bias": leaf(E, 16), "heads": heads, "counts": cnt}
    output = {"a": leaf(B, C, 80, 16), "weight": leaf(96, E * 16), "gates": (torch.rand(B, C) + 0.5).requires_grad_(),
              "heads": heads, "counts": cnt, "bias": leaf(96)}

    def proj_op(x: Tensor, weight: Tensor, bias: Tensor, heads: Tensor, counts: Tensor) -> Tensor:
        return ops.pair_project(x, weight, bias, heads, counts)

    def proj_loop(x: Tensor, weight: Tensor, bias: Tensor, heads: Tensor, counts: Tensor) -> Tensor:
        return project_loop(x, weight, bias, heads, counts)

    def out_op(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor, bias: Tensor) -> Tensor:
        return ops.pair_output(a, weight, gates, heads, counts, bias)

    def out_loop(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor, bias: Tensor) -> Tensor:
        return output_loop(a, weight, gates, heads, counts, bias)

    assert_matches(proj_op, proj_loop, project, "cuda", dtype)
    assert_matches(out_op, out_loop, output, "cuda", dtype)
