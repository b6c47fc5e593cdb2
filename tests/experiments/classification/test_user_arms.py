"""A user's own router or policy as an arm of ``condcomp ablate`` and a component of ``condcomp train``, through the
command-line entry point: the study runs it, its record names it, the results page lists it, ``condcomp eval``
imports it again from the spec the run recorded; a spec that does not import is refused before anything runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import condcomp
from condcomp.cli import main

pytestmark = pytest.mark.usefixtures("restore_registries")

TINY = ["--dataset", "synthetic", "--synthetic-train", "96", "--synthetic-test", "40", "--synthetic-len", "16",
        "--preset", "tiny", "--max-steps", "3", "--batch-size", "16", "--latency-reps", "1", "--threads", "1"]


class FirstHeadsRouter(nn.Module):
    """Always the budget's first k heads (0, 1, ...): a choice no trained scorer makes on every example, so the
    run's per-example head sets show whether this router chose them. Not registered: the spec registers it."""

    granularity = "sequence"

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def forward(self, x: Tensor, mask: Tensor | None, budget: condcomp.Budget,
                attn: condcomp.AttentionWeights) -> condcomp.HeadPlan:
        scores = -torch.arange(self.num_heads, dtype=torch.float32).expand(x.shape[0], -1)  # (B, H)
        return condcomp.plan_top_k(scores, budget.k, gates="binary")


class QuarterPolicy(nn.Module):
    """A budget of a quarter of the heads for every example (no parameters)."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def forward(self, x: Tensor, mask: Tensor | None) -> condcomp.Budget:
        s = torch.full(x.shape[:1], 0.25)  # (B,)
        return condcomp.Budget(s=s, k=condcomp.budget_k(s, self.num_heads))


SPEC = f"{__name__}:FirstHeadsRouter"


def test_a_user_router_is_an_arm_of_ablate_and_the_results_page_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    assert main(["ablate", *TINY, "--out", str(out), "--seeds", "0", "--arms", "standard",
                 "--router-arms", SPEC]) == 0
    records = {r["arm"]: r for r in json.loads((out / "summary.json").read_text())}
    assert set(records) == {"standard", "router_firstheadsrouter"}
    mine = records["router_firstheadsrouter"]
    assert mine["router"] == SPEC and mine["fraction"] == 0.5  # no BudgetFormer in this study: half the heads
    run = Path(mine["run_dir"])
    saved = json.loads((run / "metrics.json").read_text())["config"]
    assert saved["method"] == "fixed" and saved["method_options"]["router"] == SPEC
    layers = json.loads((run / "examples.json").read_text())["layers"]
    for layer in layers.values():  # 4 heads, half of them: heads 0 and 1 (bits 0b0011) on every example
        assert layer["k"] == [2] * 40 and layer["heads"] == [0b0011] * 40
    assert mine["heads"] == pytest.approx(0.5)
    capsys.readouterr()
    assert main(["report", str(out), "--no-plots"]) == 0
    page = capsys.readouterr().out
    assert "| router_firstheadsrouter |" in page


def test_train_with_a_router_from_the_current_folder_and_eval_imports_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "my_routers.py").write_text(
        "import condcomp\n"
        f"from {__name__} import FirstHeadsRouter\n\n\n"
        "@condcomp.register_router('first_heads')\n"
        "class Mine(FirstHeadsRouter):\n"
        "    pass\n")
    monkeypatch.delitem(sys.modules, "my_routers", raising=False)
    assert main(["train", *TINY, "--method", "fixed", "--router", "my_routers:Mine", "--out", "run"]) == 0
    assert "fixed/fixed+router_first_heads" in capsys.readouterr().out  # the row names the component
    assert json.loads(Path("run/metrics.json").read_text())["config"]["method_options"] == {
        "router": "my_routers:Mine"}
    del sys.modules["my_routers"]
    condcomp.registry.ROUTERS._entries.pop("first_heads")  # a fresh process: nothing registered yet
    assert main(["eval", "run/checkpoint", "--out", "again"]) == 0
    heads = json.loads(Path("again/examples.json").read_text())["layers"]
    assert all(layer["heads"] == [0b0011] * 40 for layer in heads.values())


def test_a_spec_that_does_not_import_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ablate", *TINY, "--out", str(tmp_path), "--router-arms", "no_such_module:Router"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "cannot import no_such_module" in err and "PYTHONPATH" in err
    with pytest.raises(SystemExit):
        main(["train", *TINY, "--out", str(tmp_path), "--router", "nope"])
    assert "no router of that name" in capsys.readouterr().err
    assert not (tmp_path / "synthetic").exists()


def test_a_user_policy_is_an_arm_with_the_topk_scorer(tmp_path: Path) -> None:
    spec = f"{__name__}:QuarterPolicy"
    assert main(["ablate", *TINY, "--out", str(tmp_path), "--seeds", "0", "--arms", "standard",
                 "--policy-arms", spec]) == 0
    records = {r["arm"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    mine = records["policy_quarterpolicy"]
    assert mine["policy"] == spec and mine["method_options"] == {"policy": spec}
    assert mine["s_mean"] == pytest.approx(0.25) and mine["heads"] == pytest.approx(0.25)  # 1 of the 4 heads
    layers = json.loads((Path(mine["run_dir"]) / "examples.json").read_text())["layers"]
    assert all(layer["k"] == [1] * 40 for layer in layers.values())
