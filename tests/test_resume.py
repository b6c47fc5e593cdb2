"""Every resumable command resumes to exactly the run it interrupted.

Each test runs a small command three times in child processes (tests/resume_child.py, ``--threads 1``): once
without interruption; once interrupted by a real SIGINT (a user's Ctrl-C) sent as soon as its first checkpoint
exists, checked to have landed (KeyboardInterrupt, a checkpoint left, no result); then the same command again,
which resumes. The resumed run's weights and records must equal the uninterrupted run's bit for bit (timings
aside). The generators' capture and the refusal of other settings are tested on their own first.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from condcomp.resume import ResumeError, ResumeFile, capture_rng, restore_rng

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "resume_child.py"


# --------------------------------------------------------------------------------------------- the mechanism
def test_every_generator_comes_back_to_the_captured_state() -> None:
    np = pytest.importorskip("numpy")
    own = torch.Generator().manual_seed(5)
    state = capture_rng({"order": own})
    want = (torch.rand(3), random.random(), np.random.rand(2), torch.rand(2, generator=own))
    torch.manual_seed(123), random.seed(123), np.random.seed(123), own.manual_seed(123)
    restore_rng(state, {"order": own})
    got = (torch.rand(3), random.random(), np.random.rand(2), torch.rand(2, generator=own))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and (got[2] == want[2]).all()
    assert torch.equal(got[3], want[3])
    with pytest.raises(ResumeError, match=r"generators \['order'\], this run has \[\]"):
        restore_rng(state)


def test_a_checkpoint_of_other_settings_is_refused_naming_each_difference(tmp_path: Path) -> None:
    path = tmp_path / "run.partial.pt"
    ResumeFile(path, {"lr": 0.05, "steps": 40, "seed": 0}).save({"step": 10, "w": torch.ones(2)})
    assert not path.with_name(path.name + ".tmp").exists()  # written aside, then renamed into place
    state = ResumeFile(path, {"lr": 0.05, "steps": 60, "seed": 0}, may_differ=("steps",)).load()
    assert state is not None and state["step"] == 10 and torch.equal(state["w"], torch.ones(2))
    with pytest.raises(ResumeError, match=r"lr 0.05 there, 0.02 now; seed 0 there, 1 now\)"):
        ResumeFile(path, {"lr": 0.02, "steps": 40, "seed": 1}).load()
    torch.save({"step": 10}, path)  # an older condcomp's checkpoint: no generators in it
    with pytest.raises(ResumeError, match="another condcomp version"):
        ResumeFile(path, {}).load()


# -------------------------------------------------------------------------------------- interrupted commands
def _start(setup: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "CONDCOMP_DEBUG"}
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would stall the child
        return subprocess.Popen([sys.executable, str(CHILD), setup, *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def run_to_end(setup: str, args: list[str], log: Path) -> None:
    proc = _start(setup, args, log)
    if proc.wait(timeout=600) != 0:
        pytest.fail(f"condcomp {' '.join(args)} failed:\n{log.read_text()[-3000:]}")


def interrupt(setup: str, args: list[str], checkpoint: Path, result: Path, log: Path) -> None:
    """Start the command, send SIGINT once ``checkpoint`` exists, and check that the interrupt landed."""
    proc = _start(setup, args, log)
    deadline = time.monotonic() + 600
    while not checkpoint.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run ended before its first checkpoint {checkpoint}:\n{log.read_text()[-3000:]}")
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=600)
    text = log.read_text()
    assert code != 0 and "KeyboardInterrupt" in text, f"the interrupt did not land (exit {code}):\n{text[-3000:]}"
    assert checkpoint.exists() and not result.exists()


def resumed_and_uninterrupted(tmp_path: Path, setup: str, args: Callable[[Path], list[str]],
                              checkpoint: Callable[[Path], Path], result: Callable[[Path], Path]) -> tuple[Path, Path]:
    """``(the folder of the interrupted-then-resumed run, the folder of the uninterrupted one)``."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    run_to_end(setup, args(whole), tmp_path / "whole.log")
    interrupt(setup, args(resumed), checkpoint(resumed), result(resumed), tmp_path / "interrupted.log")
    run_to_end(setup, args(resumed), tmp_path / "resumed.log")
    return resumed, whole


TIMINGS = frozenset({"seconds", "cpu_seconds", "eval_seconds", "train_seconds", "sampling_seconds", "wall_seconds",
                     "latency_b1", "latency_b64", "peak_mem_b64", "carbon_train", "carbon_eval", "environment",
                     "prepare_seconds", "checkpoint"})


def without_timings(record: Any) -> Any:
    """``record`` without its clock readings and paths (what differs between any two runs of one command)."""
    if isinstance(record, dict):
        return {k: without_timings(v) for k, v in record.items() if k not in TIMINGS}
    if isinstance(record, list):
        return [without_timings(v) for v in record]
    return record


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, f"differ after resuming: {unequal[:5]}"


# -- calibrate-kv: both methods (the request routers train with noise)
def _importance(path: Path) -> Path:
    path.write_text(json.dumps({"group_importance": torch.rand(4, 8, generator=torch.Generator().manual_seed(1))
                                .tolist()}))
    return path


CALIBRATE = ["calibrate-kv", "--model", "tiny-llama", "--steps", "30", "--seq-len", "300", "--sinks", "2",
             "--window", "16", "--threads", "1", "--seed", "0"]


@pytest.mark.slow
def test_calibrate_kv_request_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    importance = _importance(tmp_path / "importance.json")
    args = [*CALIBRATE, "--method", "request", "--keep", "2", "--lr", "0.05", "--importance", str(importance)]
    resumed, whole = resumed_and_uninterrupted(tmp_path, "corpus", lambda d: [*args, "--out", str(d / "r.pt")],
                                               lambda d: d / "r.partial.pt", lambda d: d / "r.pt")
    got, want = (torch.load(d / "r.pt", weights_only=True) for d in (resumed, whole))
    for a, b in zip(got.pop("scorers"), want.pop("scorers"), strict=True):
        assert_same_tensors(a, b)
    assert got == want  # the history (every loss) and settings
    assert not (resumed / "r.partial.pt").exists()


@pytest.mark.slow
def test_calibrate_kv_duo_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    args = [*CALIBRATE, "--method", "duo"]
    resumed, whole = resumed_and_uninterrupted(tmp_path, "corpus", lambda d: [*args, "--out", str(d / "g.json")],
                                               lambda d: d / "g.partial.pt", lambda d: d / "g.json")
    got, want = (json.loads((d / "g.json").read_text()) for d in (resumed, whole))
    assert got == want  # the gates (6 decimals) and the history: every recorded loss, unrounded
