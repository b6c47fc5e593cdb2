"""The ``static`` router: one fixed head set for every input (static head pruning, as a router)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.plans import plan_from_active
from condcomp.registry import register_router
from condcomp.types import AttentionWeights, Budget, HeadPlan


@register_router("static")
class StaticRouter(nn.Module):
    """Keeps the heads listed in ``heads`` for every example, whatever the input: static pruning.

    ``heads`` is a priority list of head indices: a row keeps the first ``min(budget.k, len(heads))`` of them, so
    with the ``full`` policy it keeps exactly ``heads`` (the usual static-pruning use), and with a ``fixed`` or
    learned budget it keeps a prefix of one fixed ranking. ``None`` ranks the heads ``0..H-1``. Gates are 1
    (no parameters, nothing to train); sequence granularity, so for a causal LM the plan holds for a whole
    request and the key/value groups it leaves out need no cache. Layers that prune different heads are wrapped
    by one ``condcomp.apply_`` call each (``target_modules=[name]``), as for any per-layer option.

    >>> import condcomp
    >>> r = StaticRouter(num_heads=4, heads=[3, 1])
    >>> r(torch.randn(2, 5, 8), None, Budget(torch.ones(2), torch.tensor([4, 1])), None).active.tolist()
    [[False, True, False, True], [False, False, False, True]]
    """

    granularity = "sequence"

    def __init__(self, num_heads: int, heads: Sequence[int] | None = None) -> None:
        super().__init__()
        self.validate_options(heads=heads)
        ranking = list(range(num_heads)) if heads is None else [int(h) for h in heads]
        bad = [h for h in ranking if not 0 <= h < num_heads]
        if bad:
            raise ValueError(f"static router: head indices {bad} are outside the layer's {num_heads} heads")
        self.num_heads, self.heads = num_heads, ranking
        rank = torch.full((num_heads,), num_heads + 1, dtype=torch.long)  # heads not listed are never kept
        rank[torch.tensor(ranking, dtype=torch.long)] = torch.arange(len(ranking))
        self.register_buffer("rank", rank, persistent=False)

    @staticmethod
    def validate_options(heads: Sequence[int] | None = None, **_: Any) -> None:
        if heads is None:
            return
        if isinstance(heads, (str, bytes)) or not all(isinstance(h, int) and not isinstance(h, bool) for h in heads):
            raise TypeError(f"static router: heads must be a list of head indices, got {heads!r}")
        if len(heads) == 0:
            raise ValueError("static router: heads is empty; keep at least one head (the residual alone is "
                             "remove_ plus deleting the layer's attention, not a routing choice)")
        if len(set(heads)) != len(heads):
            raise ValueError(f"static router: heads lists a head twice: {list(heads)}")

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights | None) -> HeadPlan:
        k = budget.k
        if k.dim() == 2:  # a per-token budget: its largest k (none without tokens)
            k = k.amax(-1) if k.shape[-1] else k.new_zeros(k.shape[0])  # (B,)
        keep = k.to(x.device).clamp(max=len(self.heads)).unsqueeze(-1)  # (B, 1)
        rank: Tensor = self.rank  # type: ignore[assignment]
        active = rank.to(x.device).unsqueeze(0) < keep  # (B, H)
        return plan_from_active(active)

    def routing_flops(self, T: int) -> float:
        """Nothing is computed to route."""
        return 0.0
