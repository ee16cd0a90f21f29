"""The CPU heap tuning of training ranks (core/blocks/cpu_allocator.py): set on Linux/glibc,
left alone when asked; a step's tensors then come back without page faults."""

import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

_FAULTS = """
import resource, sys, torch
from plugtron.core.blocks.cpu_allocator import keep_freed_memory
print(keep_freed_memory())
def step():
    kept = [torch.ones(1 << 18) for _ in range(16)]  # sixteen 1 MiB tensors, alive together
    return sum(t.sum() for t in kept)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(env):
    out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True,
                         env={**env, "OMP_NUM_THREADS": "1"}, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux only")
def test_freed_tensors_are_reused_without_page_faults():
    import os

    tuned, faults = _run({k: v for k, v in os.environ.items() if k != "PLUGTRON_CPU_HEAP"})
    system, system_faults = _run({**os.environ, "PLUGTRON_CPU_HEAP": "system"})
    assert tuned and not system
    # glibc's own thresholds hand each step fresh pages (16 MiB: ~4k faults a step); kept,
    # the heap serves them again (a few stray faults a step)
    assert system_faults > 20 * 2000 and faults * 10 < system_faults, (faults, system_faults)


def test_off_linux_it_does_nothing(monkeypatch):
    from plugtron.core.blocks import cpu_allocator

    monkeypatch.setattr(cpu_allocator, "_done", False)
    monkeypatch.setattr(cpu_allocator.platform, "system", lambda: "Darwin")
    assert cpu_allocator.keep_freed_memory() is False
