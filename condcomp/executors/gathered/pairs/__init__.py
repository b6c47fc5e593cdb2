"""Pair ops: projections over the selected (example, head) pairs of a sequence plan, as ``torch.library`` ops.

The ops (``torch.ops.condcomp.pair_project`` and ``torch.ops.condcomp.pair_output``, defined in ops.py) run Triton
kernels (kernels.py, launched by launch.py) on CUDA, and on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported: the tests), with row_kernels.py (launched by row_launch.py)
where every pair is one row (token plans); everywhere else the same semantics in torch
(fallback.py: gather + batched matmuls). Launch sizes come from the cap ``C`` (columns of ``heads``), never from data:
nothing reads the device back, so ``torch.compile(fullgraph=True)`` and CUDA graphs capture them.

Importing this package does not import triton (the kernels are imported at their first launch).
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch
from torch import Tensor

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@cache
def triton_available() -> bool:
    """Whether triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET`` set true): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def kernel_runs(t: Tensor) -> bool:
    """Whether the pair ops run their Triton kernels on ``t``'s device and dtype (else the torch fallback): CUDA in
    float16/bfloat16/float32, or CPU float32 under the interpreter (which has no bfloat16)."""
    if not triton_available():
        return False
    if t.device.type == "cuda":
        return t.dtype in KERNEL_DTYPES
    return t.device.type == "cpu" and t.dtype == torch.float32 and interpreting()
