"""Where a cell's time goes, for ``condcomp bench gpu-check --profile``: ``torch.profiler`` over a few calls of dense
and of every gathered variant, forward and forward+backward. Per call: the wall time under the profiler (which adds
its own overhead), the host time the operators took on the CPU and, on CUDA, the time the device was busy; a host
time near the wall time with little device time is a call bound by launches and host reads, not by arithmetic.
The operators that take the most are written as text tables beside the records."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

CALLS = 3


def _self_device_us(event: Any) -> float:
    """An operator's self time on the device in microseconds (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_variants(fns: dict[str, Callable[[], Tensor]], passes: tuple[str, ...], device: torch.device,
                     leaves: list[Tensor], rows: int = 20) -> tuple[dict[str, dict[str, Any]], str]:
    """Profile ``dense`` and every variant whose name starts with ``gathered``: per ``"variant pass"`` the
    milliseconds per call (``wall_ms``, ``host_ms``, ``device_ms``: None off CUDA), and the text of every operator
    table (sorted by device time on CUDA, by host time elsewhere)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    summary: dict[str, dict[str, Any]] = {}
    texts = []
    for name in [n for n in fns if n == "dense" or n.startswith("gathered")]:
        for pas in passes:
            sync()
            t0 = time.perf_counter()
            with profile(activities=activities) as prof:
                for _ in range(CALLS):
                    if pas == "fwd":
                        with torch.no_grad():
                            fns[name]()
                    else:
                        y = fns[name]()
                        y.backward(torch.ones_like(y))
                        for t in leaves:
                            t.grad = None
                sync()
            wall = (time.perf_counter() - t0) * 1e3 / CALLS
            events = prof.key_averages()
            host = sum(e.self_cpu_time_total for e in events) / 1e3 / CALLS
            dev = sum(_self_device_us(e) for e in events) / 1e3 / CALLS if cuda else None
            summary[f"{name} {pas}"] = {"wall_ms": round(wall, 3), "host_ms": round(host, 3),
                                        "device_ms": None if dev is None else round(dev, 3)}
            sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            texts.append(f"## {name} {pas}: per call {wall:.3f} ms wall (profiled), {host:.3f} ms host"
                         + (f", {dev:.3f} ms device" if dev is not None else "") + f" ({CALLS} calls)\n\n"
                         + events.table(sort_by=sort, row_limit=rows))
    return summary, "\n\n".join(texts) + "\n"
