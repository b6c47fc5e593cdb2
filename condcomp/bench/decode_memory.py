"""What ``condcomp bench decode`` reads of the machine besides its steps: a clock that waits for the device, the peak
memory of a prefill (the CUDA allocator's peak on a GPU, the process's peak resident set on Linux), and the bytes a
KV cache holds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device has run what was queued (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are asynchronous: time what ran, not what was queued
    return time.perf_counter()


def peak_reset(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, and the process's resident set (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:  # Linux: "5" resets the peak resident set size of this process
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_bytes(device: torch.device) -> int | None:
    """The peak since :func:`peak_reset`: the CUDA allocator's on a GPU, else the process's resident set (None where
    the system does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def held_cache_bytes(cache: Any) -> int:
    """Every tensor the cache holds: compact groups, streamed-group windows, quantized states with their scales."""
    from condcomp.integrations.hf.cache import cache_bytes

    return sum(cache_bytes(cache))


__all__ = ["device_clock", "held_cache_bytes", "peak_bytes", "peak_reset"]
