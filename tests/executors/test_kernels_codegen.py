"""Every Triton kernel (the gathered executor's pair and row kernels, the compact cache's split-K decode kernels)
compiled for an H100/H200 (sm_90) in float32 and bfloat16 on a machine without a GPU: codegen_cuda.py, in its own
process, runs the launchers as on CUDA with each launch turned into a compilation to a cubin (nothing runs). The
interpreter tests run the kernels' arithmetic in float32 only; this is the check that the GPU code generation, and
bfloat16 (what gpu-check and bench decode time), compiles at all. Skips where triton has no NVIDIA backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'condcomp[gpu]')")

KERNELS = {"pair_matmul", "pair_sum", "group_xty", "rows_matmul", "rows_xty", "row_attention", "row_attention_dq",
           "row_attention_dkdv", "partial", "reduce"}  # kernels.py, row_kernels.py, kv/kernels/split_k.py


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_in_float32_and_bfloat16(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("codegen_cuda.py")), "90"], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.stdout.startswith("SKIP:"):
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0 and "FAILED" not in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("compiled ")]
    compiled = {(kernel, dtype) for _, kernel, dtype in lines}
    assert compiled == {(k, d) for k in KERNELS for d in ("float32", "bfloat16")}
    assert list((tmp_path / "cache").rglob("*.cubin")), "no cubin was written"
