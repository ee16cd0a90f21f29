"""The C heap of a CPU training process: keep freed memory for the next step.

A training step on CPU allocates the same tensors step after step (activations, gradients, the
backward's temporaries), most of them 0.1-30 MB. glibc serves allocations above its mmap
threshold (128 KiB, raised dynamically) with fresh ``mmap`` pages and returns them on free, and
trims the top of its heap above 128 KiB: every step then touches new pages, one page fault per
4 KiB, inside the kernels that write them. Measured on a 4-layer GPT stage (hidden 256, 256
tokens): 124k page faults against 65k, and a split backward's ``I`` + ``W`` 1.28x a combined
backward against 1.21x, because the ``W`` closures keep gradients alive across the ``I`` and so
push its allocations onto fresh pages (benchmarks/RESULTS.md, "Split backward").

:func:`keep_freed_memory` sets glibc's mmap threshold to its maximum (32 MiB on 64-bit) and its
trim threshold to 1 GiB, so that freed blocks stay in the heap for the next step; the resident
set then stays at the step's peak instead of shrinking between steps. Only glibc on Linux, only
for CPU ranks (a GPU's activations are not on this heap); ``PLUGTRON_CPU_HEAP=system`` leaves
glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: ``system``: leave glibc's own thresholds.
SWITCH_ENV = "PLUGTRON_CPU_HEAP"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc's heap for a CPU training process (once); True when set."""
    global _done
    if _done:
        return True
    if os.environ.get(SWITCH_ENV) == "system" or platform.system() != "Linux" \
            or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False
    return _done
