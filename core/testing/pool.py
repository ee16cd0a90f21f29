"""A pool of gloo processes that a test module starts once and runs many checks on.

Spawning processes and importing torch in each costs seconds, so a module makes one pool and
runs every check on it::

    import pytest
    from plugtron.testing import DistributedPool

    @pytest.fixture(scope="module")
    def pool():
        with DistributedPool(8) as p:
            yield p

    def _check_sum(rank, world_size, value):     # module level: it is pickled by name
        import torch, torch.distributed as dist
        t = torch.tensor([value * rank])
        dist.all_reduce(t)
        return t.item()

    def test_sum(pool):
        assert pool.run(_check_sum, 2) == [56] * 8
        assert pool.run(_check_sum, 2, world_size=2) == [2, 2]

``pool.run(fn, *args, **kwargs)`` calls ``fn(rank, world_size, *args, **kwargs)`` in every rank
and returns the per-rank results in rank order. ``world_size=k`` runs it on a world of the first
``k`` ranks instead: the pool re-forms ``torch.distributed``'s world (cheap next to spawning
processes) so one pool serves every layout up to its size. With ``k == 1`` no process group
exists, as in a single-process run. An exception in any rank is raised in the test as
:class:`RankFailure` carrying every failing rank's traceback; a hang becomes a ``TimeoutError``.
After either, the pool restarts its processes on the next ``run`` so later tests start clean.

Ranks are forked from a server process that imported torch (its compiler stack too, which the
first optimizer imports) and plugtron once (``multiprocessing``'s forkserver, where the platform
has it): a rank starts in a fraction of a second instead of the four or so that importing takes,
and a suite that starts dozens of pools pays for the imports once. A rank gets the parent's
``sys.path``, working directory and environment as they are when the pool starts, as a spawned
one would; what torch and plugtron read from the environment while they are imported is read once,
when the server starts.

Worker processes keep state between runs in :func:`worker_cache` (e.g. a ``ParallelContext``
whose groups were already created), since creating process groups is a collective that costs
time. Re-forming the world empties the cache: groups of the old world are gone.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CACHE: dict = {}


def worker_cache() -> dict:
    """A dict that lives as long as the worker process (one per rank) and its world; empty in a
    fresh pool and after the pool re-forms its world for another size.

    All ranks run the same functions in the same order, so creating cached process groups on a
    miss stays collective-safe.
    """
    return _CACHE


class RankFailure(AssertionError):
    """One or more ranks raised; ``tracebacks`` maps rank -> traceback text."""

    def __init__(self, tracebacks: dict[int, str]):
        self.tracebacks = dict(sorted(tracebacks.items()))
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in self.tracebacks.items())
        super().__init__(f"{len(tracebacks)} rank(s) failed: {sorted(tracebacks)}\n{text}")


class _World:
    """This worker's membership in ``torch.distributed``'s default world, re-formed on demand.

    Every rank sees the same sequence of sizes (each task goes to all ranks), so the numbered
    store files agree without any coordination.
    """

    def __init__(self, rank: int, store_dir: str, backend: str, timeout_s: float):
        self.rank, self.store_dir, self.backend = rank, store_dir, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.size = None
        self.generation = 0

    def join(self, size: int, fresh: bool = False) -> None:

        if size == self.size and not fresh:
            return
        # What the last task built (a model, its gradient buffers) can sit in reference cycles
        # that hold process groups; collected now, their gloo threads and sockets go with the
        # world instead of piling up in a long-lived rank.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        _CACHE.clear()
        self.generation += 1
        self.size = size
        if size > 1 and self.rank < size:
            store = os.path.join(self.store_dir, f"store-{self.generation}")
            dist.init_process_group(self.backend, init_method=f"file://{store}", rank=self.rank,
                                    world_size=size, timeout=self.timeout)


#: What the fork server imports before it forks any rank: the costly imports every rank makes.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "plugtron.api",
           "plugtron.core.training.loop", __name__]


def _context():
    """A forkserver context whose server has :data:`PRELOAD` imported, else spawn's."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, the first time only
    return ctx


def _worker(rank, world_size, store_dir, backend, timeout_s, tasks, results, environ=None):
    if environ is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are local: loopback only
    world = _World(rank, store_dir, backend, timeout_s)
    try:
        world.join(world_size)
        results.put((None, rank, True, b""))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((None, rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, size, fresh, payload = task
        try:
            world.join(size, fresh)
            if rank < size:
                fn, args, kwargs = pickle.loads(payload)
                out = (task_id, rank, True, pickle.dumps(fn(rank, size, *args, **kwargs)))
            else:
                out = (task_id, rank, True, b"")  # outside this task's world: idle
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            out = (task_id, rank, False, traceback.format_exc())
        results.put(out)
    if dist.is_initialized():
        dist.destroy_process_group()


class DistributedPool:
    """``world_size`` processes, each with ``torch.distributed`` initialised, that run tasks.

    ``timeout`` (seconds) bounds each ``run`` and the start-up; ``grace`` is how long to wait for
    the other ranks once one has failed before declaring them hung and restarting.
    """

    def __init__(self, world_size: int, timeout: float = 300.0, backend: str = "gloo",
                 grace: float = 10.0):
        self.world_size = world_size
        self.timeout = timeout
        self.backend = backend
        self.grace = grace
        self._procs: list = []
        self._task_id = 0
        self._tmpdir: str | None = None
        self._fresh = False

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the processes and wait until each has joined the process group."""
        if self._procs:
            return
        self._tmpdir = tempfile.mkdtemp(prefix="plugtron-pool-")
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        for rank in range(self.world_size):
            p = ctx.Process(target=_worker, daemon=True, name=f"pool-rank-{rank}",
                            args=(rank, self.world_size, self._tmpdir, self.backend,
                                  self.timeout, self._tasks[rank], self._results,
                                  dict(os.environ)))
            p.start()
            self._procs.append(p)
        self._collect(None, "start-up")

    def run(self, fn, *args, world_size: int | None = None, timeout: float | None = None,
            **kwargs) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` in every rank of a world of
        ``world_size`` ranks (default: the whole pool); results in rank order."""
        size = self.world_size if world_size is None else world_size
        if not 1 <= size <= self.world_size:
            raise ValueError(f"world_size {size} does not fit a pool of {self.world_size}")
        self.start()
        payload = pickle.dumps((fn, args, kwargs))
        self._task_id += 1
        fresh, self._fresh = self._fresh, False
        for q in self._tasks:
            q.put((self._task_id, size, fresh, payload))
        results = self._collect(self._task_id, getattr(fn, "__name__", repr(fn)), timeout)
        return results[:size]

    def refresh(self) -> None:
        """The next ``run`` re-forms the world and empties :func:`worker_cache` in every rank,
        as a new pool would, but keeps the processes (and their imports): how one pool serves
        several test modules without one module's groups or cache reaching the next."""
        self._fresh = True

    def _collect(self, task_id, what: str, timeout: float | None = None) -> list:
        deadline = time.monotonic() + (timeout or self.timeout)
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        while len(results) + len(failures) < self.world_size:
            if failures:
                deadline = min(deadline, time.monotonic() + self.grace)
            try:
                tid, rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = {i: p.exitcode for i, p in enumerate(self._procs) if not p.is_alive()}
                if dead:
                    for r, code in dead.items():
                        failures.setdefault(r, f"process exited with code {code}")
                    self._abort()
                    raise RankFailure(failures)
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
                    self._abort()
                    if failures:
                        raise RankFailure(failures | {r: "hung after other ranks failed"
                                                      for r in missing})
                    raise TimeoutError(f"{what}: ranks {missing} did not finish in time")
                continue
            if tid != task_id:
                continue  # a late answer to an earlier, aborted task
            if ok:
                results[rank] = pickle.loads(value) if value else None
            else:
                failures[rank] = value
        if failures:
            if task_id is None:
                self._abort()
            raise RankFailure(failures)
        return [results[r] for r in range(self.world_size)]

    def _abort(self) -> None:
        """Kill the processes (some may be stuck in a collective); the next run restarts."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        self._reset()

    def _reset(self) -> None:
        self._procs = []
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()  # never block interpreter exit on unread tasks
            q.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def close(self) -> None:
        """Ask every process to leave the process group and exit; kill any that do not."""
        if not self._procs:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self._reset()


def run_on_ranks(fn, world_size: int, *args, **kwargs) -> list:
    """Start a pool of ``world_size`` ranks, call ``fn(rank, world_size, *args, **kwargs)`` in
    each, close the pool and return the results in rank order. For one-off checks; a module with
    several should share one :class:`DistributedPool` (start-up costs seconds)."""
    with DistributedPool(world_size) as pool:
        return pool.run(fn, *args, **kwargs)
