"""The GPU part of run_h200.sh: ``bench gpu-check``, ``bench decode --device cuda`` and ``bench kv`` at 4096 tokens,
one after the other in one process, so that SmolLM2's GGUF file is dequantized once (about 30 s) instead of once per
benchmark. Each job gets a wall-clock budget; a job that outruns it is interrupted (``bench kv`` keeps every variant
it finished: its records are reused by a later run with the same arguments).

    python3 results/bench/device/gpu_jobs.py OUT_FOLDER DEADLINE_SECONDS [DATA_DIR]

``GPU_JOBS=decode_cuda,kv_short`` runs only the named jobs; ``SNAPSHOT=FILE.tgz`` packs OUT_FOLDER into FILE after
each job (what a call that is stopped early still returns).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import condcomp.experiments.llm.smollm2 as smollm2

_LOADED: dict[tuple[Any, str], tuple[Any, Any]] = {}
_load = smollm2.load_smollm2


def load_once(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """The loader the benchmarks call, answering a fresh copy of the model loaded once (each benchmark wraps it)."""
    key = (dtype, attn_implementation)
    if key not in _LOADED:
        _LOADED[key] = _load(dtype, attn_implementation)
    model, tokenizer = _LOADED[key]
    return copy.deepcopy(model), tokenizer


smollm2.load_smollm2 = load_once  # the benchmarks import it inside their functions, so they see this one


class OutOfTime(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise OutOfTime


KV_CONDCOMP = ["dense", "quantized-fp8", "split-duo-1of3", "split-duo-1of3+fp8", "streaming", "split-request-1of3",
               "split-duo-1of3-seed1", "split-static-1of3", "split-request-1of3+fp8"]
KV_PRESS = ["kvpress-streaming-0.50", "kvpress-snapkv-0.50", "kvpress-expected-0.50", "kvpress-tova-0.50",
            "kvpress-knorm-0.50", "kvpress-streaming-0.25", "kvpress-snapkv-0.25", "kvpress-expected-0.25",
            "kvpress-tova-0.25", "kvpress-knorm-0.25", "kvpress-adakv-snapkv-0.50", "kvpress-duo-gates-1of3"]


KV_SHORT = ["dense", "split-duo-1of3", "streaming", "kvpress-streaming-0.50", "quantized-fp8", "split-duo-1of3+fp8",
            "split-request-1of3"]


def snapshot(folder: Path) -> None:
    if path := os.environ.get("SNAPSHOT"):
        with tarfile.open(path, "w:gz") as tar:
            tar.add(folder, arcname=folder.name)


def main() -> int:
    out, deadline = Path(sys.argv[1]), time.monotonic() + float(sys.argv[2])
    data = sys.argv[3] if len(sys.argv) > 3 else "../shared/data"
    kv = ["bench", "kv", "--preset", "cpu", "--prompts", "4096", "--cases", "100", "--continuations", "8",
          "--facts", "1", "--time-decode", "--device", "cuda", "--importance", "results/llm/static_importance.json",
          "--data-dir", data, "--out", str(out / "kv_facts_4096"), "--variants"]
    jobs = [  # (name, argv, seconds at most)
        ("gpu_check", ["bench", "gpu-check", "--out", str(out / "gpu_check")], 110),
        ("decode_cuda", ["bench", "decode", "--model", "smollm2", "--device", "cuda", "--prompts", "512", "2048",
                         "4096", "--batches", "1", "8", "32", "--reps", os.environ.get("DECODE_REPS", "5"),
                         "--variants", "dense", "full",
                         "keep_0.33", "--out", str(out / "decode_cuda")], 170),
        ("kv_condcomp", kv + KV_CONDCOMP, 10_000),
        ("kv_all", kv + KV_CONDCOMP + KV_PRESS, 10_000),
        ("kv_short", kv + KV_SHORT, 10_000),
    ]
    if chosen := os.environ.get("GPU_JOBS"):
        jobs = [job for job in jobs if job[0] in chosen.split(",")]
    else:
        jobs = [job for job in jobs if job[0] != "kv_short"]
    from condcomp.cli import main as cli

    signal.signal(signal.SIGALRM, _alarm)
    log = []
    for name, argv, budget in jobs:
        seconds = int(min(budget, deadline - time.monotonic()))
        if seconds < 20:
            log.append({"job": name, "status": "skipped: out of time"})
            continue
        t0 = time.monotonic()
        signal.alarm(seconds)
        try:
            status: Any = cli(argv)
        except OutOfTime:
            status = f"interrupted after {seconds} s"
        except BaseException:  # a failed job must not stop the next one; its traceback goes to the log
            status = "failed: " + traceback.format_exc(limit=8)
        finally:
            signal.alarm(0)
        log.append({"job": name, "status": status, "seconds": round(time.monotonic() - t0, 1)})
        print(json.dumps(log[-1])[:2000], flush=True)
        torch.cuda.empty_cache()
        (out / "gpu_jobs.json").write_text(json.dumps(log, indent=1))
        snapshot(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
