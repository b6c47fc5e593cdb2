"""The gathered executor's tuning: every threshold that picks a strategy, as one frozen object per device.

The CPU values were measured on a 2-core x86 CPU with MKL (``condcomp bench attention`` and ``condcomp bench
scatter``; docs/performance.md has the tables). The CUDA values are the CPU values except that ``auto`` runs dense
attention below a much larger skipped work: on one H200 (``results/bench/gpu_check/h200``, bfloat16) the gathered
executor was 1.9-9.6x slower than dense at every budget, up to B*T*D = 33.5 million (29 million skipped). Larger
calls were not measured there, so the threshold sits at about twice that and ``measured`` stays False; it will be
replaced by the crossovers of a GPU record of the capturable path. On CUDA a sequence plan runs that capturable path
(``static_sequence``: ``sequence.static``, no host read, shapes from the plan's ``k_cap``) whenever the gathered
executor runs it, named (``executor="gathered"``) or chosen by ``auto``; on CPU only under ``torch.compile``; token
plans likewise (``static_token``: ``token.static``, or ``token.triton`` with the pair kernels on). A
:class:`GatheredExecutor` holds one (``tuning=``) or picks the one of the call's device; tests pass their own instead
of rewriting module globals.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from condcomp.options import Option, check_fields, count, flag, real

MAX_SET_HEADS = 24  # the per-set strategy's histogram has 2**max_set_heads bins: 16 million at most


@dataclass(frozen=True)
class GatheredTuning:
    """Thresholds of the gathered executor's strategies and of its cost estimate for ``executor="auto"``.

    - ``min_grouped_copy``: a sequence plan whose examples all use the same number of heads runs as one batched
      block, gathering about ``pairs * 3 * Dh * D`` weight floats, while that is below this; at or above it, grouped
      GEMMs (grouped/block measured 1.07-1.35x at 0.2-0.8 million floats, 0.85-0.91x at 3.1 million).
    - ``grouped_gemm``: use MKL's grouped GEMMs where the build has them (False: the batched-matmul strategies only).
    - ``dense_head_rows``: token plans: a head chosen by at least this share of the query rows runs densely.
    - ``max_set_heads``: token plans with at most this many heads also count rows per head set (a ``2**H``-bin
      histogram in the one host read), which the per-set strategy needs.
    - ``max_head_sets``: the per-set strategy runs while the rows chose at most this many distinct routed-head sets
      (MoH's top-2 of 6 makes 15).
    - ``min_set_work``: ... and while mean rows per set times the model width is at least this (per-set/per-head
      measured 0.99-1.08x at about 70,000, 0.81-0.98x from 140,000 on).
    - ``dense_work_sequence`` / ``dense_work_token``: ``auto`` prefers dense attention (``masked``) when the plan
      keeps at least this share of the dense (query row, head) work.
    - ``min_skipped_work_sequence`` / ``min_skipped_work_token``: ... or when the work it skips,
      ``(1 - share) * B*T*D``, is below this (gathered's fixed cost outweighs it in small calls).
    - ``measured``: whether these values were measured on this kind of device.
    - ``static_sequence``: sequence plans run the capturable strategy ``sequence.static`` (no device -> host read,
      ``k_cap`` heads per example padded with gate 0) in eager mode too; under ``torch.compile`` it runs on any
      device whatever this says. On for CUDA (a host read stalls the stream), off for CPU (the sized strategies
      are at the k-head floor there).
    - ``static_token``: token plans run the capturable strategies (``token.triton`` where the pair kernels may run,
      else ``token.static``: no device -> host read, shapes from the plan's ``shared_heads`` and ``k_cap``) in eager
      mode too; under ``torch.compile`` on any device whatever this says. On for CUDA, off for CPU (the sized token
      strategies are at the floor there).
    - ``pair_kernels``: let ``sequence.triton`` (the Triton pair ops) run calls sized without a host read on CUDA
      where triton is available, before ``sequence.static`` (False: ``sequence.static``). Off in the CUDA tuning
      until a GPU has timed the kernels.
    - ``pair_kernels_on_cpu``: ... and on CPU too: the ops' torch fallback, or the kernels under
      ``TRITON_INTERPRET=1``. For tests; off by default.

    >>> tuning_for(torch.device("cpu")).measured
    True
    """

    device: str = "cpu"
    measured: bool = True
    min_grouped_copy: int = 2_000_000
    grouped_gemm: bool = True
    dense_head_rows: float = 0.8
    max_set_heads: int = 12
    max_head_sets: int = 32
    min_set_work: int = 100_000
    dense_work_sequence: float = 0.8
    dense_work_token: float = 0.65
    min_skipped_work_sequence: int = 60_000
    min_skipped_work_token: int = 300_000
    static_sequence: bool = False
    static_token: bool = False
    pair_kernels: bool = True
    pair_kernels_on_cpu: bool = False
    options: ClassVar[tuple[Option, ...]] = (
        flag("measured"), count("min_grouped_copy", meaning="weight floats"), flag("grouped_gemm"),
        real("dense_head_rows", at_least=0, at_most=1, meaning="a share of the query rows"),
        count("max_set_heads", at_most=MAX_SET_HEADS, meaning="heads whose 2**H head sets are counted"),
        count("max_head_sets", meaning="distinct routed-head sets"), count("min_set_work", meaning="rows x width"),
        real("dense_work_sequence", at_least=0, at_most=1, meaning="a share of the dense work"),
        real("dense_work_token", at_least=0, at_most=1, meaning="a share of the dense work"),
        count("min_skipped_work_sequence", meaning="B*T*D skipped"), count("min_skipped_work_token",
                                                                           meaning="B*T*D skipped"),
        flag("static_sequence"), flag("static_token"), flag("pair_kernels"), flag("pair_kernels_on_cpu"),
    )

    def __post_init__(self) -> None:
        check_fields(self, "GatheredTuning")

    def prefers_dense(self, work_fraction: float, granularity: str, size: int | None = None) -> bool:
        """Whether a plan keeping ``work_fraction`` of the dense work runs faster densely; ``size`` is ``B*T*D``
        (None: the share alone decides)."""
        token = granularity == "token"
        min_skipped = self.min_skipped_work_token if token else self.min_skipped_work_sequence
        if size is not None and (1.0 - work_fraction) * size < min_skipped:
            return True
        return work_fraction >= (self.dense_work_token if token else self.dense_work_sequence)


CPU = GatheredTuning()
# auto: dense on CUDA unless a call skips more (query row, head) work than one H200 run measured as slower (above)
# sequence.triton is opt-in on CUDA (pair_kernels=True) until a GPU record exists: its kernels have run only under
# Triton's interpreter; sequence.static (torch ops only) is the default capturable path there
CUDA = replace(CPU, device="cuda", measured=False, min_skipped_work_sequence=64_000_000,
               min_skipped_work_token=64_000_000, static_sequence=True, static_token=True,
               pair_kernels=False)


def tuning_for(device: torch.device) -> GatheredTuning:
    """The tuning of a device type (an unmeasured copy of the CPU values for anything but CPU and CUDA)."""
    if device.type == "cpu":
        return CPU
    if device.type == "cuda":
        return CUDA
    return replace(CPU, device=device.type, measured=False)
