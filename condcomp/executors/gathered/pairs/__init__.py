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
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from condcomp.executors.gathered.call import GatheredCall

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


def tf32_matmul() -> bool:
    """Whether torch allows TF32 for float32 CUDA matmuls (the pair kernels then multiply float32 as TF32, as torch's
    matmul does). Read through ``torch.backends.cuda.matmul.fp32_precision`` where torch has it (2.9+): reading the
    legacy ``allow_tf32`` raises once the new API set the precision (``fp32_precision = "tf32"``)."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.fp32_precision == "tf32")
    except AttributeError:  # torch before 2.9: the legacy flag only
        return bool(matmul.allow_tf32)


def call_rejections(call: GatheredCall) -> list[str]:
    """Why a call cannot run the Triton pair kernels (empty: it can), for the strategies that use them
    (``sequence.triton``, ``token.triton``): CUDA only unless ``tuning.pair_kernels_on_cpu``, triton installed, a
    kernel dtype, and inputs, cache and weights of one dtype and device."""
    x, w, i = call.inputs.x, call.weights, call.inputs
    reasons = []
    if x.device.type != "cuda" and not call.tuning.pair_kernels_on_cpu:
        reasons.append(f"the Triton pair kernels run on CUDA only (this call is on {x.device.type}; "
                       "tuning.pair_kernels_on_cpu runs them here for tests)")
    elif x.device.type == "cuda" and not triton_available():
        reasons.append("triton is not installed (pip install 'condcomp[gpu]')")
    if x.device.type == "cuda" and x.dtype not in KERNEL_DTYPES:
        reasons.append(f"the Triton pair kernels run float16, bfloat16 and float32, not {x.dtype}")
    tensors = [i.key, i.value, i.key_states, i.value_states, w.q_weight, w.k_weight, w.v_weight, w.o_weight]
    if not all(t.dtype == x.dtype and t.device == x.device for t in tensors if t is not None):
        reasons.append("inputs, cache and weights differ in dtype or device")
    return reasons
