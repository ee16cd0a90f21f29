"""Memory per step for the metrics file: the peak allocated on a GPU, the resident set on a CPU."""

from __future__ import annotations

import os

import torch


def step_memory_mb(device: torch.device) -> float:
    """CUDA: the peak allocated since the previous call (then reset), in MiB. CPU: this
    process's resident set now, in MiB (what the OS charges the rank)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource  # noqa: PLC0415 - POSIX only
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, KiB on Linux
