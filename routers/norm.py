"""MoH's parameter-free router for continue-tuning pretrained models: score = L2 norm of each head's query."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from condcomp.options import Option, flag
from condcomp.plans import plan_from_active, top_k_mask
from condcomp.registry import register_router
from condcomp.types import AttentionWeights, Budget, HeadPlan

from .moh import HEAD_OPTIONS, check_head_options, resolve_heads, routed_counts


@register_router("norm")
class QueryNormRouter(nn.Module):
    """The first ``shared_heads`` heads always on; per token, the Top-K other heads by ``||q_h||_2``; binary gates.

    No parameters, so it converts a pretrained model as is (MoH-LLaMA3: 16 of 32 heads shared, Top-8 of the
    other 16). Gates are exactly 0/1 in value; in training with ``straight_through=True`` they carry the
    gradient of ``softmax(||q||)`` over the routed heads, which reaches the query projection. Rotary embeddings
    rotate query pairs and leave the norm unchanged, so scoring the unrotated queries is exact.
    Budget and defaults as the ``moh`` router (full policy -> ``top_k``; otherwise, and always under
    ``condcomp.budget``, ``k - h_s`` routed heads;
    ``h_s = H // 2``, ``K = (H - h_s) // 2``); padding tokens get no heads.

    >>> import condcomp
    >>> attn = condcomp.HeadAttention(16, 4)
    >>> r = QueryNormRouter(num_heads=4, shared_heads=1, top_k=2)
    >>> plan = r(torch.randn(1, 3, 16), None, Budget(torch.ones(1), torch.full((1,), 4)), attn.weights())
    >>> plan.counts.tolist(), plan.active[..., 0].all().item()
    ([[3, 3, 3]], True)
    """

    granularity = "token"
    options: ClassVar[tuple[Option, ...]] = (*HEAD_OPTIONS, flag("straight_through", meaning="gradient to the queries"))

    def __init__(self, num_heads: int, shared_heads: int | None = None, top_k: int | None = None,
                 straight_through: bool = True) -> None:
        super().__init__()
        self.validate_options(shared_heads=shared_heads, top_k=top_k)
        self.num_heads = num_heads
        self.shared_heads, self.top_k = resolve_heads("norm router", num_heads, shared_heads, top_k)
        self.straight_through = bool(straight_through)

    @staticmethod
    def validate_options(shared_heads: int | None = None, top_k: int | None = None, **_: Any) -> None:
        check_head_options("norm router", shared_heads, top_k)

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan:
        B, T, _ = x.shape
        hs, H = self.shared_heads, self.num_heads
        rows = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.bool()  # (B, T)
        K = routed_counts(budget, (B, T), H, hs, self.top_k).masked_fill(~rows, 0)  # (B, T)
        shared = rows.unsqueeze(-1).expand(B, T, hs)
        if hs == H:
            return plan_from_active(shared.contiguous())
        q = attn.project_queries(x)[:, :, hs:].float()  # (B, T, E, Dh): routed heads only
        scores = q.norm(dim=-1)  # (B, T, E)
        routed = top_k_mask(scores, K)
        active = torch.cat([shared, routed], dim=-1)  # (B, T, H)
        gates = active.float()
        if self.training and self.straight_through:
            probs = torch.softmax(scores, dim=-1)
            surrogate = torch.cat([torch.zeros_like(shared, dtype=probs.dtype), probs], dim=-1)
            gates = gates + (surrogate - surrogate.detach())
        return plan_from_active(active, gates)

    @property
    def fewest_heads(self) -> int:
        """Heads computed for every real token whatever the budget (the shared ones): ``condcomp.budget`` refuses a
        fraction below them."""
        return self.shared_heads

    def routing_flops(self, T: int) -> float:
        """Per example: the routed heads' queries are computed anyway; the norms cost 2 * Dh per (token, head)."""
        return 0.0
