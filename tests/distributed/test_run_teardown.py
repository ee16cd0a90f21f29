"""A finished run leaves nothing behind in its process: no plugin manager, parallel context or
model stays alive, so neither do their process groups (each gloo group holds threads and
sockets). A process that trains several times (a notebook, a sweep, a test pool's rank) must
not pile them up: a cache keyed by the run's ``schedule_actions`` hook caller once kept every
run's plugin manager, and with it its groups, alive (core/plugins/signatures.py), and the gradient
hooks that held the data-parallel wrapper made every model an uncollectable cycle
(core/parallel/ddp.py)."""

from __future__ import annotations

from plugtron.testing import train_run

#: tp 2 x pp 2 with the distributed optimizer: tp, pp, dp and embedding groups, gradient
#: buffers with their hooks, P2P between the stages.
FLAGS = {"tp": 2, "pp": 2, "num-layers": 4, "global-batch-size": 8,
         "optimizer": "distributed-adam", "train-iters": 2}


def _left_over(rank, world_size):
    """What of earlier runs is still alive in this rank, after a full collection."""
    import gc
    import os

    import pluggy
    from plugtron.core.parallel.context import ParallelContext
    from plugtron.core.parallel.ddp import DistributedDataParallel

    gc.collect()
    alive = {kind.__name__: sum(isinstance(o, kind) for o in gc.get_objects())
             for kind in (pluggy.PluginManager, ParallelContext, DistributedDataParallel)}
    threads = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                threads += f.read().startswith(("pt_gloo", "gloo"))
        except OSError:  # the thread ended while listed
            pass
    return alive, threads


def test_runs_in_one_process_leave_nothing_behind(rank_pool_factory):
    pool = rank_pool_factory(4)
    gloo_threads = []
    for _ in range(3):
        train_run(FLAGS, world_size=4, pool=pool)
        # A world of another size in between: the next run's world, and its groups, are new.
        for alive, threads in pool.run(_left_over, world_size=4)[:1] + \
                pool.run(_left_over, world_size=2):
            assert alive == {"PluginManager": 0, "ParallelContext": 0,
                             "DistributedDataParallel": 0}, alive
        gloo_threads.append(pool.run(_left_over, world_size=4)[0][1])
    # Only the groups of the world the last run built, which its next build replaces.
    assert gloo_threads[2] == gloo_threads[1], gloo_threads
