"""Attention kernels for a compact KV cache's decode steps: one launch per layer over the kept groups' pools.

:func:`compact_decode_attention` attends one query token per request over each request's pool slots ``(B, G, S,
Dh)``, reading only slots ``[0, length)`` of each (request, slot): a split-K decode kernel in Triton (Polar
Sparsity's ``select_attn`` pattern, flash-decoding's split and reduce) with a grid fixed by the shapes and
everything else read on the device, so ``torch.compile(fullgraph=True)`` and CUDA graphs capture it. Read it in
this order: ops.py (the custom op, its checks and its entry point), split_k.py (the kernels), launch.py (their
grid), fallback.py (the same semantics in torch, used where the kernels do not run).

A wrapped decoder uses it for the compact cache's decode steps on a static cache when its config asks
(``CondCompConfig(decode_kernel=True)``, docs/llm-compiled.md). Importing this package does not import triton.
"""

from __future__ import annotations

from condcomp.kv.kernels.ops import compact_decode_attention, tiling

__all__ = ["compact_decode_attention", "tiling"]
