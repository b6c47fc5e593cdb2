"""What a gathered strategy is: a named way to compute a sized call that says why it cannot run it, or runs it.

Strategies are listed, in the order they are tried, in one dispatch table (strategies.py); the first whose ``supports``
returns no reason runs. Every rejection is a sentence, so ``condcomp.explain`` can show why a strategy did not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch import Tensor

from condcomp.executors.gathered.sizing import GatherSizes, routed_head_sets
from condcomp.executors.gathered.tuning import GatheredTuning
from condcomp.masks import AttentionMask, build_attention_mask
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan


@dataclass(frozen=True)
class TokenSplit:
    """A token plan's heads by how they run: ``dense`` (nearly every row chose them: one dense block),
    ``routed`` (gathered), and the routed-head ``sets`` with their rows (None: too many, or not counted)."""

    dense: list[int]
    routed: list[int]
    sets: list[tuple[int, int]] | None


@dataclass(frozen=True)
class GatheredCall:
    """One sized call: what every strategy's ``supports`` and ``run`` receive."""

    weights: AttentionWeights
    inputs: AttentionInputs
    plan: HeadPlan
    sizes: GatherSizes
    tuning: GatheredTuning

    @cached_property
    def mask(self) -> AttentionMask:
        return build_attention_mask(self.inputs, self.weights.layout.causal, self.inputs.x.dtype)

    @cached_property
    def pairs(self) -> int:
        """Sequence plans: the selected (example, head) pairs."""
        return sum(k * n for k, _, n in self.sizes.buckets)

    @cached_property
    def token_split(self) -> TokenSplit:
        rows, T = self.sizes.rows_per_head, self.inputs.x.shape[1]
        bound = self.tuning.dense_head_rows * T
        dense = [h for h, n in enumerate(rows) if n > 0 and n >= bound]
        routed = [h for h, n in enumerate(rows) if 0 < n < bound]
        sets = None
        if self.sizes.head_sets:
            sets = routed_head_sets(self.sizes.head_sets, routed, self.tuning.max_head_sets)
        return TokenSplit(dense, routed, sets)


class Strategy:
    """A named way to compute a plan of one granularity. Subclasses set ``name`` (``"<granularity>.<what>"``)
    and ``granularity``, and implement :meth:`run`; :meth:`supports` lists why it cannot run a call (empty: it
    can). A strategy never reads the device: everything it decides on is in ``call.sizes`` and ``call.tuning``.
    ``needs_sizes``: it decides on sizes read back from the device; a call sized without that read
    (``call.sizes.read`` False: under ``torch.compile``, or ``tuning.static_sequence``) goes to the strategies
    that set it False."""

    name: str = ""
    granularity: str = ""
    needs_sizes: bool = True

    def supports(self, call: GatheredCall) -> list[str]:
        return []

    def run(self, call: GatheredCall) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"
