"""Every resumable command resumes to exactly the run it interrupted.

Each test runs a small command three times in child processes (tests/resume_child.py, ``--threads 1``): once
without interruption, in a process beside the other two; once interrupted by a real SIGINT (a user's Ctrl-C) sent
as soon as its first checkpoint exists, checked to have landed (KeyboardInterrupt, a checkpoint left, no result);
then the same command again, which resumes. The resumed run's weights and records must equal the uninterrupted
run's bit for bit (timings aside). The generators' capture and the refusal of other settings are tested on their
own first.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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


def test_the_calibration_loop_resumed_in_process_draws_the_same_noise(tmp_path: Path) -> None:
    """calibrate-kv's loop (duo_gates.train_loop) with a step that draws noise, as the request routers do: stopped
    at its step-10 checkpoint and resumed after the global generator moved on, it ends as one uninterrupted run."""
    from condcomp.experiments.llm.duo_gates import train_loop

    def run(steps: int, checkpoint: Path, settings: dict[str, Any] | None = None) -> tuple[torch.Tensor, Any]:
        torch.manual_seed(0)
        frozen, w = torch.nn.Linear(2, 2), torch.nn.Linear(3, 1)
        opt = torch.optim.Adam(w.parameters(), lr=0.1)

        def step_fn(step: int, ids: torch.Tensor) -> tuple[float, float]:
            noisy = torch.rand(3) + 0.1 * torch.randn(3)  # (3,)
            loss = (w(noisy) - ids.float().mean()).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return float(loss.detach()), float(noisy.sum())

        history = train_loop(frozen, w, opt, [[1, 2], [3, 4]], settings or {"steps": steps, "lr": 0.1}, step_fn,
                             checkpoint)
        return w.weight.detach().clone(), history

    want = run(20, tmp_path / "whole.pt")
    run(10, tmp_path / "cut.pt")  # a run of 10 steps leaves its step-10 checkpoint: the run "stopped" there
    torch.manual_seed(99)
    got = run(20, tmp_path / "cut.pt")
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    with pytest.raises(ResumeError, match=r"lr 0.1 there, 0.2 now"):
        run(20, tmp_path / "cut.pt", {"steps": 20, "lr": 0.2})
    with pytest.raises(ResumeError, match="at step 20, past this run's --steps 15"):
        run(15, tmp_path / "cut.pt")


# -------------------------------------------------------------------------------------- interrupted commands
def _start(setup: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "CONDCOMP_DEBUG"}
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would stall the child
        return subprocess.Popen([sys.executable, str(CHILD), setup, *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=env)


def run_to_end(setup: str, args: list[str], log: Path) -> None:
    finish(_start(setup, args, log), args, log)


def finish(proc: subprocess.Popen[bytes], args: list[str], log: Path) -> None:
    """Wait for a run started with ``_start``; it must have ended well."""
    if proc.wait(timeout=600) != 0:
        pytest.fail(f"condcomp {' '.join(args)} failed:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def beside(setup: str, args: list[str], log: Path) -> Iterator[None]:
    """The uninterrupted run, in a process of its own while the block runs the interrupted one (two children at
    ``--threads 1`` on two cores: the test waits for the longer of the two, not their sum); it must end well."""
    proc = _start(setup, args, log)
    try:
        yield
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finish(proc, args, log)


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
                              checkpoint: Callable[[Path], Path], result: Callable[[Path], Path],
                              saved_step: Callable[[Path], int], steps: int) -> tuple[Path, Path]:
    """``(the folder of the interrupted-then-resumed run, the folder of the uninterrupted one)``; ``saved_step``
    reads the step a checkpoint holds: the interrupt must have landed mid-training (before ``steps``)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    with beside(setup, args(whole), tmp_path / "whole.log"):
        interrupt(setup, args(resumed), checkpoint(resumed), result(resumed), tmp_path / "interrupted.log")
        assert 0 < saved_step(checkpoint(resumed)) < steps, "the interrupt landed after training"
        run_to_end(setup, args(resumed), tmp_path / "resumed.log")
    return resumed, whole


# what differs between any two runs of one command: clock readings, memory peaks, the machine, paths
UNREPEATABLE = frozenset({"environment", "peak_mem_b64", "command", "run_dir", "checkpoint"})


def without_timings(record: Any) -> Any:
    """``record`` without its clock readings, the machine and paths."""
    if isinstance(record, dict):
        return {k: without_timings(v) for k, v in record.items() if not (
            k in UNREPEATABLE or k.endswith("seconds") or k.startswith(("latency", "carbon")))}
    if isinstance(record, list):
        return [without_timings(v) for v in record]
    return record


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, f"differ after resuming: {unequal[:5]}"


def file_step(checkpoint: Path) -> int:
    return int(torch.load(checkpoint, weights_only=True)["step"])


# -- calibrate-kv: both methods (the request routers train with noise)
def _importance(path: Path) -> Path:
    path.write_text(json.dumps({"group_importance": torch.rand(4, 8, generator=torch.Generator().manual_seed(1))
                                .tolist()}))
    return path


CALIBRATE = ["calibrate-kv", "--model", "tiny-llama", "--steps", "20", "--seq-len", "300", "--sinks", "2",
             "--window", "16", "--threads", "1", "--seed", "0"]


@pytest.mark.slow
def test_calibrate_kv_request_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    importance = _importance(tmp_path / "importance.json")
    args = [*CALIBRATE, "--method", "request", "--keep", "2", "--lr", "0.05", "--importance", str(importance)]
    resumed, whole = resumed_and_uninterrupted(tmp_path, "corpus", lambda d: [*args, "--out", str(d / "r.pt")],
                                               lambda d: d / "r.partial.pt", lambda d: d / "r.pt", file_step, 20)
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
                                               lambda d: d / "g.partial.pt", lambda d: d / "g.json", file_step, 20)
    got, want = (json.loads((d / "g.json").read_text()) for d in (resumed, whole))
    assert got == want  # the gates (6 decimals) and the history: every recorded loss, unrounded


# -- tune-llm (a tiny random Llama for SmolLM2; MoH's routers trained with the LoRA adapters)
def _staged(root: Path) -> Path:
    """ag_news and yelp stand-ins of random letters, in the staged corpora's layout."""
    import gzip

    rng = random.Random(0)
    for name in ("ag_news", "yelp"):
        for split in ("train", "test"):
            (root / name).mkdir(parents=True, exist_ok=True)
            with gzip.open(root / name / f"{split}.jsonl.gz", "wt", encoding="utf-8") as fh:
                for _ in range(200):
                    text = "".join(rng.choice("abcdefghijklm") for _ in range(rng.randint(5, 15)))
                    fh.write(json.dumps({"text": text, "label": 0}) + "\n")
    return root


@pytest.mark.slow
def test_tune_llm_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    data = _staged(tmp_path / "data")
    args = ["tune-llm", "--variants", "moh_50", "--data-dir", str(data), "--threads", "1", "--seq-len", "16",
            "--prompt-len", "6", "--batch-size", "2", "--steps", "60", "--warmup", "2", "--lora-rank", "2",
            "--eval-seqs", "2", "--calib-seqs", "1", "--agree-prompts", "2", "--agree-tokens", "3",
            "--checkpoint-every", "5", "--datasets", "ag_news", "yelp"]
    resumed, whole = resumed_and_uninterrupted(
        tmp_path, "tiny-smollm", lambda d: [*args, "--out", str(d)], lambda d: d / "moh_50" / "checkpoint.pt",
        lambda d: d / "moh_50" / "metrics.json", file_step, 60)
    got, want = (torch.load(d / "moh_50" / "checkpoint.pt", weights_only=True) for d in (resumed, whole))
    assert got["step"] == want["step"] == 60
    assert_same_tensors(got["trainable"], want["trainable"])
    got, want = (json.loads((d / "moh_50" / "metrics.json").read_text()) for d in (resumed, whole))
    assert without_timings(got) == without_timings(want)  # every loss of the history, perplexity, greedy tokens


# -- train and ablate (the classifier; BudgetFormer's routers, dropout and shuffled batches draw from generators)
CLASSIFIER = ["--dataset", "synthetic", "--synthetic-train", "160", "--synthetic-test", "40", "--preset", "tiny",
              "--batch-size", "8", "--max-steps", "60", "--checkpoint-every", "5", "--latency-reps", "1",
              "--threads", "1"]


def checkpoint_step(checkpoint: Path) -> int:
    return int(json.loads(checkpoint.read_text())["train_state"]["step"])


def assert_same_run(got: Path, want: Path) -> None:
    """Two run folders of the classifier hold the same weights, metrics and per-example predictions."""
    from safetensors.torch import load_file

    assert_same_tensors(*(load_file(str(d / "checkpoint" / "model.safetensors")) for d in (got, want)))
    for name in ("metrics.json", "examples.json"):
        a, b = (json.loads((d / name).read_text()) for d in (got, want))
        assert without_timings(a) == without_timings(b), name


@pytest.mark.slow
def test_train_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    args = ["train", *CLASSIFIER, "--method", "budgetformer"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    with beside("none", [*args, "--out", str(whole)], tmp_path / "whole.log"):
        interrupt("none", [*args, "--out", str(resumed)], resumed / "checkpoint" / "condcomp.json",
                  resumed / "metrics.json", tmp_path / "interrupted.log")
        assert 0 < checkpoint_step(resumed / "checkpoint" / "condcomp.json") < 60
        run_to_end("none", [*args, "--out", str(resumed), "--resume"], tmp_path / "resumed.log")
    assert_same_run(resumed, whole)


@pytest.mark.slow
def test_ablate_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    args = ["ablate", *CLASSIFIER, "--seeds", "0", "--arms", "standard", "budgetformer"]
    resumed, whole = resumed_and_uninterrupted(
        tmp_path, "none", lambda d: [*args, "--out", str(d / "runs"), "--summary", str(d / "summary.json")],
        lambda d: d / "runs" / "synthetic" / "seed0" / "budgetformer" / "checkpoint" / "condcomp.json",
        lambda d: d / "runs" / "synthetic" / "seed0" / "budgetformer" / "metrics.json", checkpoint_step, 60)
    for arm in ("standard", "budgetformer"):
        assert_same_run(*(d / "runs" / "synthetic" / "seed0" / arm for d in (resumed, whole)))
    got, want = (json.loads((d / "summary.json").read_text()) for d in (resumed, whole))
    assert without_timings(got) == without_timings(want)


# -- dit (a learned budget with its timestep input; batches, timesteps and noise drawn from the loop's generator)
@pytest.mark.slow
def test_dit_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    args = ["dit", "--seeds", "0", "--variants", "budgetformer_cond", "--steps", "80", "--checkpoint-every", "5",
            "--batch-size", "8", "--samples-per-class", "2", "--sample-steps", "2", "--threads", "1", "--no-plots",
            "--model", json.dumps({"d_model": 40, "num_layers": 1, "freq_dim": 16})]
    run = Path("seed0") / "budgetformer_cond"
    resumed, whole = resumed_and_uninterrupted(tmp_path, "quick-judge", lambda d: [*args, "--out", str(d)],
                                               lambda d: d / run / "checkpoint.pt", lambda d: d / run / "metrics.json",
                                               file_step, 80)
    got, want = (torch.load(d / run / "samples.pt", weights_only=True) for d in (resumed, whole))
    assert torch.equal(got, want)  # sampled from the EMA weights: the same images bit for bit
    got, want = (json.loads((d / run / "metrics.json").read_text()) for d in (resumed, whole))
    assert without_timings(got) == without_timings(want)  # Fréchet distance, accuracy, heads per noise level
    assert not (resumed / run / "checkpoint.pt").exists()


# -- bench kv: resumes per finished (variant, prompt length) record, not mid-measurement
@pytest.mark.slow
def test_bench_kv_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    variants = ["dense", "drop-keep1of3", "split-static-1of3"]
    args = ["bench", "kv", "--model", "tiny-llama", "--preset", "quick", "--prompts", "320", "400",
            "--variants", *variants, "--time-decode", "--threads", "1", "--importance", str(tmp_path / "absent.json")]
    resumed, whole = resumed_and_uninterrupted(
        tmp_path, "corpus", lambda d: [*args, "--out", str(d)], lambda d: d / "records" / "dense@320.json",
        lambda d: d / "metrics.json", lambda c: len(list(c.parent.glob("*.json"))), 6)
    names = sorted(p.name for p in (whole / "records").glob("*.json"))
    assert len(names) == 6 and names == sorted(p.name for p in (resumed / "records").glob("*.json"))
    for name in names:
        assert (resumed / "records" / name).read_text() == (whole / "records" / name).read_text(), name
    got, want = (json.loads((d / "metrics.json").read_text()) for d in (resumed, whole))
    assert without_timings(got) == without_timings(want)
