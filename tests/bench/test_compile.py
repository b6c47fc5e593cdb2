"""torch.compile: a routed model (HeadAttention layers + apply_) compiles with every registered executor and
matches eager, forward and backward. Compilation is slow on shared CPUs: one tiny model, ``aot_eager`` (dynamo
capture + AOTAutograd, no C++ codegen) for every executor and inductor for the dense-friendly one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import condcomp
from condcomp.bench.compile import POLICIES, build, explain, fullgraph_ok, table

pytestmark = pytest.mark.slow
EXECUTORS = condcomp.list_executors()
D, H, LAYERS = 16, 4, 1


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, D, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    return x, mask


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("executor", EXECUTORS)
def test_compiled_matches_eager(executor: str) -> None:
    model = build(executor, D, H, LAYERS, s=0.5)
    x, mask = _data()
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(x, mask), model(x, mask), atol=1e-6, rtol=1e-5)
    info = explain(model, x, mask)  # whatever breaks (gathered: host-side bucket sizes) says where and why
    assert info["graphs"] == info["graph_breaks"] + 1
    assert all(info["break_reasons"]) and len(info["break_reasons"]) <= info["graph_breaks"]


def test_compiled_training_step_matches_eager() -> None:
    model = build("masked", D, H, LAYERS, s=0.5).train()  # the topk router adds noise: same seed for both
    compiled = torch.compile(model, backend="aot_eager")
    x, mask = _data()
    xg = x.clone().requires_grad_()
    torch.manual_seed(5)
    eager_loss = model(xg, mask).square().mean()
    (gx_eager,) = torch.autograd.grad(eager_loss, [xg])
    torch.manual_seed(5)
    compiled_loss = compiled(xg, mask).square().mean()
    (gx_compiled,) = torch.autograd.grad(compiled_loss, [xg])
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gx_compiled, gx_eager, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("executor", [e for e in ("masked", "reference", "gathered") if e in EXECUTORS])
def test_executors_compile_with_fullgraph(executor: str) -> None:
    """gathered too: under torch.compile it runs sequence.static (no host read, fixed shapes)."""
    model = build(executor, D, H, LAYERS, s=0.5)
    x, mask = _data()
    torch.compile(model, fullgraph=True, backend="eager")(x, mask)  # raises on any graph break
    torch._dynamo.reset()
    torch.compile(model.train(), fullgraph=True, backend="eager")(x, mask)  # router noise traces too


def test_inductor_codegen_matches_eager() -> None:
    model = build("masked", D, H, LAYERS, s=0.5)
    x, mask = _data()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(x, mask), model(x, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_benchmark_captures_gathered_at_fixed_and_budgetformer_plans(policy: str) -> None:
    model = build("gathered", D, H, LAYERS, s=0.5, policy=policy)
    x, mask = _data()
    assert fullgraph_ok(model, x, mask) == (True, "")
    assert explain(model, x, mask) == {"graphs": 1, "graph_breaks": 0, "break_reasons": []}


def test_the_benchmark_table_names_the_policy() -> None:
    record = {"executor": "gathered", "policy": "budgetformer_capped", "B": 1, "T": 2, "D": 3, "H": 4, "layers": 1,
              "s": 0.25, "threads": 1, "reps": 1, "fullgraph": True, "graphs": 1, "graph_breaks": 0,
              "break_reasons": [], "compile_s": 1.0, "eager_ms": 2.0, "compiled_ms": 1.0, "speedup": 2.0,
              "max_abs_diff": 0.0}
    assert "| gathered | budgetformer_capped | - | yes | 1 | 0 |" in table([record])
    moh = {**record, "policy": "moh", "strategy": "token.static", "device": "cpu"}
    assert "| gathered | moh | token.static | yes | 1 | 0 |" in table([moh]) and ", cpu, 1 threads" in table([moh])


def test_the_benchmark_runs_moh_token_plans_on_the_capturable_path() -> None:
    """The MoH row: gathered at MoH's token plans, captured whole and run by token.static under compile."""
    model = build("gathered", D, H, LAYERS, s=0.5, policy="moh")
    x, mask = _data()
    torch.compile(model, fullgraph=True, backend="eager")(x, mask)
    assert {u.strategy for u in condcomp.head_usage(model).values()} == {"token.static"}
    plan = next(m.last.plan for m in model.modules() if isinstance(m, condcomp.RoutedAttention))
    assert plan.shared_heads == 1 and plan.k_cap == 2  # H = 4: one shared head, top-1 routed


def test_the_benchmark_refuses_cuda_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from condcomp.bench.compile import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        run(quick=True, reps=1, threads=1, executors=["masked"], device="cuda")


def test_the_benchmark_writes_each_row_as_it_finishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed during its second row (on a GPU: a time limit) has written its first row already."""
    import condcomp.bench.compile as bench_compile
    from condcomp.cli import main

    class Killed(BaseException):
        pass

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # no codegen: the rows' bookkeeping only
    real, calls = bench_compile.explain, []

    def explain(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> dict[str, object]:
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        return real(model, x, mask)

    monkeypatch.setattr(bench_compile, "explain", explain)
    with pytest.raises(Killed):
        main(["bench", "compile", "--quick", "--reps", "1", "--threads", "1", "--executors", "masked",
              "--out", str(tmp_path)])
    records = json.loads((tmp_path / "metrics.json").read_text())["records"]
    assert [r["executor"] for r in records] == ["dense"]
    assert "| dense |" in (tmp_path / "table.md").read_text()
