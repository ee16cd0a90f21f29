"""Where a fresh process's 10M-sample blend spends its time (RESULTS.md's git history: data pipeline fourth
pass): each variant named on the command line runs, in that order, in its own fresh child,
which times allocating the outputs, the first call into them and a second call into the same
arrays, with the minor faults (getrusage) and the machine's huge-page and compaction counters
(/proc/vmstat) of each phase.

    flock /tmp/plugtron-tests.lock .venv/bin/python benchmarks/blend_first_touch.py \\
        plugtron-nohuge plugtron plugtron megatron-nohuge megatron megatron

Variants: ``plugtron``, ``plugtron-general`` (the compiled general loop, which was plugtron's only
loop before the register loop for 2-8 datasets) or ``megatron`` (needs megatron-core), with any
of these appended: ``-nohuge`` (numpy does not ask for transparent huge pages), ``-torch`` (torch
imported first), ``-pretouch`` (the outputs written once before the first call, timed as their
own phase, so that the first call is the loop alone in a fresh process) and ``-light`` (Megatron's
compiled helpers_cpp loaded from its file without importing megatron.core, which takes seconds).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

SIZE = 10_000_000
KEYS = ("compact_stall", "thp_fault_alloc", "thp_fault_fallback")


def vmstat() -> dict:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f) if k in KEYS}


def load_helpers_cpp():
    """megatron/core/datasets/helpers_cpp*.so as a module, without megatron.core's __init__."""
    import glob
    import importlib.util
    import site

    path = next(p for d in site.getsitepackages()
                for p in glob.glob(f"{d}/megatron/core/datasets/helpers_cpp*.so"))
    spec = importlib.util.spec_from_file_location("helpers_cpp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(variant: str) -> dict:
    start = time.perf_counter()
    if "torch" in variant:
        import torch  # noqa: F401
    import numpy as np

    megatron = variant.startswith("megatron")
    if megatron and "light" in variant:
        helpers_cpp = load_helpers_cpp()
    elif megatron:
        from megatron.core.datasets import helpers_cpp
    else:
        from plugtron.plugins.datasets import gpt_indices

        helpers = gpt_indices._helpers()
    if "nohuge" in variant:
        np._core.multiarray._set_madvise_hugepage(False)
    weights, counts = np.array([0.2, 0.5, 0.3]), np.zeros(3, dtype=np.int64)

    def call(d, s):
        if megatron:
            helpers_cpp.build_blending_indices(d, s, weights, 3, SIZE, False)
        else:  # the same call gpt_indices.build_blending_indices makes, on arrays given here
            helpers.build_blending_indices(d.ctypes.data, s.ctypes.data, weights.ctypes.data, 3,
                                           SIZE, counts.ctypes.data, int("general" in variant))

    out = {"variant": variant, "import_s": round(time.perf_counter() - start, 3)}
    marks = [(time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)]
    vm_before = vmstat()

    def mark(name):
        now, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out[f"{name}_ms"] = round((now - marks[-1][0]) * 1e3, 1)
        out[f"{name}_faults"] = faults - marks[-1][1]
        marks.append((now, faults))

    allocate = np.zeros if megatron else np.empty  # as each side allocates its outputs
    d, s = allocate(SIZE, dtype=np.int16), allocate(SIZE, dtype=np.int64)
    mark("alloc")
    if "pretouch" in variant:
        d.fill(1)
        s.fill(1)
        mark("pretouch")
    call(d, s)
    mark("first_call")
    vm_after = vmstat()
    out["vmstat"] = {k: vm_after[k] - vm_before[k] for k in KEYS}
    call(d, s)
    mark("second_call")
    out["digest"] = int(d.sum()) + int(s.sum())
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2])))
        return
    for variant in sys.argv[1:]:
        done = subprocess.run([sys.executable, __file__, "--child", variant], check=True,
                              capture_output=True, text=True)
        print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
