"""A compact cache in preallocated storage, read with positions held on the device (what ``torch.compile`` needs).

A static cache layer holds the kept key/value groups of every row in storage allocated once for the request,
``(B, g, S, Dh)`` with ``g`` the batch's largest count of kept groups (the plan is fixed at prefill, so ``g`` is a
host constant for the whole decode) and ``S`` the cache's maximum length. How many tokens it holds is a device
tensor (``held``, a scalar: the cache position of the next write), which every decode step advances in place.

Nothing here reads a length back to the host: a decode step's shapes depend only on ``B``, ``g``, ``S`` and the
call's ``T``, which do not change from step to step, so a compiled step is captured once (no recompilation per
step, no graph break). The functions below are what a call needs besides the storage: where its tokens go, which
of its queries are real tokens (a padded batch), and which pool positions each query may read when the caller
gives no mask (the positions not yet written are masked, not sliced off).
"""

from __future__ import annotations

import torch
from torch import Tensor

from condcomp.masks import additive_bias


def query_positions(held: Tensor, T: int) -> Tensor:
    """``(T,)`` the cache positions of a call's ``T`` tokens, written after the ``held`` (a device scalar) it held."""
    return torch.arange(T, device=held.device) + held


def query_rows(key_ok: Tensor, held: Tensor, T: int) -> Tensor:
    """``(B, T)``: whether each of the call's queries is a real token, read from ``key_ok (B, S)`` (the keys some
    query may attend: padding excluded) at the queries' positions after ``held`` tokens."""
    B, S = key_ok.shape
    pos = query_positions(held, T).clamp(max=S - 1)  # a position past the pool: the call itself is refused later
    return key_ok.gather(1, pos.unsqueeze(0).expand(B, T))


def written_bias(held: Tensor, T: int, S: int, dtype: torch.dtype, window: int | None = None) -> Tensor:
    """Additive ``(1, 1, T, S)``: the query at ``held + i`` may read the pool positions ``<= held + i`` (written
    before it, or by this call), never the ones not yet written; with a ``window``, only the last ``window`` of
    them (the model's own sliding window)."""
    j = torch.arange(S, device=held.device)[None, :]
    pos = query_positions(held, T)[:, None]
    allowed = j <= pos  # (T, S)
    if window is not None:
        allowed = allowed & (j > pos - window)
    return additive_bias(allowed, dtype)[None, None]


__all__ = ["query_positions", "query_rows", "written_bias"]
