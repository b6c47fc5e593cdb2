"""Attention masks in the one form every executor consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from condcomp.types import AttentionInputs


@dataclass(frozen=True)
class AttentionMask:
    """What an executor passes to its attention kernel.

    ``mask`` is None (no masking, or plain causal with ``is_causal``), a bool ``(B|1, H|1, T|1, S)`` tensor
    (True = may attend; ``T|1``: key padding alone is not repeated per query) or an additive float tensor of
    that shape. Query rows with no allowed key are ``dead`` ``(B|1, H|1, T|1)``: their mask row is opened (so
    softmax stays finite) and executors zero their output afterwards, which is why an all-padding row yields
    zeros rather than NaN.
    """

    mask: Tensor | None
    is_causal: bool
    dead: Tensor | None

    def for_rows(self, rows: Tensor, heads: Tensor) -> AttentionMask:
        """The mask of the (example, head) pairs ``rows (P,)``, ``heads (P,)``, as ``(P, 1, T|1, S)``."""
        if self.mask is None:
            return self
        m = self.mask
        b = rows if m.shape[0] > 1 else torch.zeros_like(rows)
        h = heads if m.shape[1] > 1 else torch.zeros_like(heads)
        dead = None
        if self.dead is not None:
            db = rows if self.dead.shape[0] > 1 else torch.zeros_like(rows)
            dh = heads if self.dead.shape[1] > 1 else torch.zeros_like(heads)
            dead = self.dead[db, dh].unsqueeze(1)  # (P, 1, T|1)
        return AttentionMask(m[b, h].unsqueeze(1), self.is_causal, dead)


def check_mask_dtype(mask: Tensor | None, name: str) -> None:
    """Refuse a mask that is neither bool nor floating point, as torch's attention does (an integer mask would
    otherwise be read as an additive bias, or as bool with a different meaning than the caller's)."""
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"only bool and floating types of {name} are supported (as in torch), got {mask.dtype}; "
                        f"convert it: {name}.bool() for True/False, or a float additive mask")


def causal_allowed(T: int, S: int, device: torch.device) -> Tensor:
    """Bottom-right aligned causal mask ``(T, S)``: query i sees keys ``j <= i + S - T`` (KV-cache decoding)."""
    i = torch.arange(T, device=device).unsqueeze(1)
    j = torch.arange(S, device=device).unsqueeze(0)
    return j <= i + (S - T)


def additive_bias(allowed: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A bool mask (True = may attend) as the additive bias attention adds to its scores: 0 where allowed, ``-inf``
    where not, same shape (``dtype`` None: torch's default float type)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def causal_bias(T: int, S: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Additive ``(1, 1, T, S)`` bias of bottom-right aligned causal attention (:func:`causal_allowed`)."""
    return additive_bias(causal_allowed(T, S, device), dtype)[None, None]


def attended_keys(allowed: Tensor, B: int, S: int) -> Tensor:
    """``(B, S)`` bool: the keys some query may attend, from a bool mask of allowed (query, key) pairs that
    broadcasts to ``(B, H, T, S)``. A key no query may attend is padding: policies pool over the others."""
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    return allowed.any(dim=1).any(dim=1).expand(B, S)  # (B|1, H|1, T|1, S) -> (B, S)


def build_attention_mask(inputs: AttentionInputs, causal: bool, dtype: torch.dtype) -> AttentionMask:
    """Combine key padding, causal structure and an additive bias into one :class:`AttentionMask`."""
    x = inputs.x
    T, S, device = x.shape[1], inputs.num_keys, x.device
    if inputs.key_mask is None and inputs.attn_bias is None:
        if not causal or T == S:
            return AttentionMask(None, causal, None)
        if T == 1:  # one decoding query, the last position: it sees every key (no mask to build per step)
            return AttentionMask(None, False, None)
    allowed: Tensor | None = None
    if inputs.key_mask is not None:
        allowed = inputs.key_mask[:, None, None, :].bool()  # (B, 1, 1, S)
    if causal:
        c = causal_allowed(T, S, device)[None, None]  # (1, 1, T, S)
        allowed = c if allowed is None else allowed & c
    if inputs.attn_bias is None:
        assert allowed is not None
        if causal:
            allowed = allowed.expand(allowed.shape[0], 1, T, S)
        # else key padding alone stays (B, 1, 1, S): a (B, 1, T, S) copy would cost B*T*S bytes for nothing
        # (8 GiB-scale at long T), and a row is dead only when its whole example is padding.
        dead = ~allowed.any(-1)  # (B|1, 1, T); no branch on it: that would sync the device every layer
        return AttentionMask(allowed | dead.unsqueeze(-1), False, dead)
    bias = inputs.attn_bias.to(dtype)
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    bias = bias.expand(bias.shape[0], bias.shape[1], T, S)
    dead = torch.isneginf(bias).all(-1)  # (B|1, H|1, T)
    return AttentionMask(bias.masked_fill(dead.unsqueeze(-1), 0.0), False, dead)


def dead_rows(mask: AttentionMask, B: int, T: int) -> Tensor | None:
    """``(B, T)`` True where a query row has no allowed key in any head (its output is exactly zero)."""
    if mask.dead is None:
        return None
    return mask.dead.all(1).expand(B, T)


def streaming_allowed(query_pos: Tensor, key_pos: Tensor, sinks: int, window: int) -> Tensor:
    """The streaming rule ``(B, T, S)``: a query at real-token position ``p`` may attend a key at ``j`` when
    ``0 <= j <= p`` and ``j < sinks`` (attention sinks) or ``p - j < window`` (the recent band). Positions count a
    request's real tokens (padding is ``-1`` and sees and is seen by nothing); ``query_pos (B, T)``,
    ``key_pos (B, S)``.

    >>> p = torch.arange(5)[None]
    >>> streaming_allowed(p, p, sinks=1, window=2)[0, 4].tolist()
    [True, False, False, True, True]
    """
    q = query_pos.unsqueeze(-1)  # (B, T, 1)
    k = key_pos.unsqueeze(-2)  # (B, 1, S)
    return (q >= 0) & (k >= 0) & (k <= q) & ((k < sinks) | (q - k < window))
