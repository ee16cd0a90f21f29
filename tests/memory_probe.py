"""Measured memory of a few training steps on CPU, for tests/core/tools/test_memory_estimate.py.

"Measured peak" is the resident-set high-water mark (``VmHWM``) of the rank's process during
setup and the first steps, minus its resident set just before the datasets and the model are
built (at ``plugtron_process_groups_ready``, after ``gc.collect()`` and glibc's
``malloc_trim(0)``, with the high-water mark reset through ``/proc/self/clear_refs``). A
one-layer, one-step warm-up run of the same flags goes first, so that imports and torch's lazy
initialisation (thread pools, kernels) are in the baseline, not in the peak. So the peak is
what building and training the model added to the process: weights, gradients, optimizer
state, activations and every transient, as the OS charges them.
"""

from __future__ import annotations

import ctypes
import gc
import re

from plugtron.core.contracts.hookspecs import hookimpl


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


class RssBaseline:
    """Extension plugin: takes the baseline when the process groups are ready."""

    rss0 = 0

    @hookimpl
    def plugtron_process_groups_ready(self, parallel):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        self.rss0 = _status_kib("VmRSS") * 1024


def measure_training(config, world=None) -> dict:
    """Train ``config`` on this process's world; the measured peak and the estimate."""
    import copy

    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.tools.estimate import estimate_memory
    from plugtron.core.training.loop import setup, train

    warm = copy.deepcopy(config)
    # one layer per virtual pipeline stage (a V-shape schedule has two chunks per rank)
    p = warm.parallel
    chunks = p.virtual_pipeline_model_parallel_size or (
        2 if warm.plugins.schedule in ("zbv", "dualpipev") else 1)
    warm.model.num_layers = p.pipeline_model_parallel_size * chunks
    warm.training.train_iters = 1
    warm_run = setup(warm, world=world)
    train(warm_run, MetricsLogger(warm, rank=1))
    del warm_run
    baseline = RssBaseline()
    run = setup(config, extra_plugins=[baseline], world=world)
    train(run, MetricsLogger(config, rank=1))
    peak = _status_kib("VmHWM") * 1024 - baseline.rss0
    estimate = estimate_memory(config, run.world.world_size, cuda=False)
    mine = next(r for r in estimate.ranks if run.world.rank in r.ranks)
    numel = sum(p.numel() for chunk in run.model_chunks for p in chunk.module.parameters())
    return {"measured": peak, "estimated": mine.total, "numel": numel,
            "estimated_numel": mine.parameters, "row": vars(mine)}
