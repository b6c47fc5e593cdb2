"""Compile every Triton kernel condcomp launches for a CUDA target, on a machine without a GPU (run by
test_kernels_codegen.py in its own process; ``python tests/executors/codegen_cuda.py [ARCH]`` by hand).

Triton's interpreter (how the other tests run the kernels on CPU) has no bfloat16 and generates no GPU code, so a
kernel that only fails to compile for a GPU, or only in bfloat16, would first fail on a lent GPU. Here the launchers
run as they would on CUDA, with a stand-in for triton's CUDA driver (it names the target: ``sm_ARCH``, default 90,
an H100/H200) and every launch turned into a compilation without a launch (``JITFunction.run(..., warmup=True)``):
each kernel is compiled to a cubin by triton's own ptxas; nothing runs, so the outputs are not looked at. Prints one
``compiled KERNEL DTYPE`` line per kernel compiled for calls of that dtype, ``FAILED ...`` per call that raised, or
a single ``SKIP: why`` line where this triton cannot do it (no NVIDIA backend, other internals).
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import replace
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be triton JIT functions, not interpreted ones


def skip(why: str) -> None:
    print(f"SKIP: {why}", flush=True)
    sys.exit(0)


try:
    import triton
    import triton.runtime.jit as jit
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
except ImportError as e:
    skip(f"triton or its internals are not importable here ({e})")
if "nvidia" not in backends or not hasattr(driver, "set_active"):
    skip(f"triton {triton.__version__} has no NVIDIA backend or no driver.set_active")

import torch  # noqa: E402

ARCH = int(sys.argv[1]) if len(sys.argv) > 1 else 90
DTYPES = (torch.float32, torch.bfloat16)


class TargetOnly:
    """What ``JITFunction.run`` asks of the driver before compiling: the device, its stream, the target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return GPUTarget("cuda", ARCH, 32)


compiled: set[tuple[str, str]] = set()  # (kernel, the dtype of the call that launched it)
calling = [""]
real_run = jit.JITFunction.run


def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
    compiled.add((self.fn.__name__, calling[0]))
    return kernel


def main() -> None:
    driver.set_active(TargetOnly())
    jit.JITFunction.run = compile_only  # type: ignore[method-assign]

    import condcomp.executors.gathered.pairs as pairs
    import condcomp.executors.gathered.pairs.ops as pair_ops
    import condcomp.kv.kernels.ops as kv_ops
    from condcomp.bench.gpu_check import case
    from condcomp.executors.gathered import CUDA, GatheredExecutor
    from condcomp.kv.kernels import compact_decode_attention

    def on_cuda(t: torch.Tensor) -> bool:  # the launchers' choice on CUDA, made for these CPU tensors
        return t.dtype in pairs.KERNEL_DTYPES

    pair_ops.kernel_runs = on_cuda  # type: ignore[attr-defined]
    kv_ops.kernel_runs = on_cuda  # type: ignore[attr-defined]
    tuning = replace(CUDA, pair_kernels=True, pair_kernels_on_cpu=True, static_sequence=False, static_token=False)
    failed = 0
    cpu = torch.device("cpu")
    for dtype in DTYPES:
        calling[0] = str(dtype).removeprefix("torch.")
        for name, strategy in (("seq_gqa", "sequence.triton"), ("token_causal", "token.triton")):
            torch.manual_seed(0)
            w, inputs, plan, _ = case(name, dtype, cpu, quick=True)
            try:
                with torch.no_grad():
                    GatheredExecutor(tuning=tuning, strategy=strategy)(w, inputs, plan)
                GatheredExecutor(tuning=tuning, strategy=strategy)(w, inputs, plan).float().sum().backward()
            except Exception:
                failed += 1
                print(f"FAILED {strategy} {name} {dtype}:\n{traceback.format_exc(limit=3)}", flush=True)
        B, G, R, Dh = 2, 2, 3, 64
        for S in (40, 5000):  # one split, and several (the reduce kernel)
            q = torch.randn(B, G * R, 1, Dh).to(dtype)
            k, v = torch.randn(B, G, S, Dh).to(dtype), torch.randn(B, G, S, Dh).to(dtype)
            lengths = torch.tensor([[S, S // 2], [0, 7]], dtype=torch.int32)
            try:
                compact_decode_attention(q, k, v, lengths, Dh**-0.5, kv_index=torch.tensor([[0, 1], [1, 0]]),
                                         group_size=R, bias=torch.zeros(B, S))
            except Exception:
                failed += 1
                print(f"FAILED compact_decode_attention S={S} {dtype}:\n{traceback.format_exc(limit=3)}", flush=True)
    for kernel, dtypes in sorted(compiled):
        print(f"compiled {kernel} {dtypes}", flush=True)
    print(f"done: {len(compiled)} kernels compiled for sm_{ARCH}, {failed} calls failed", flush=True)


if __name__ == "__main__":
    main()
