"""Saving a run's checkpoint: snapshot on the main thread, write (in the background with
``--async-save``), commit on the main thread.

Megatron's async save: the training loop waits only while tensors are copied to host memory;
a thread writes the files. Collectives never run in that thread: between steps the main thread
asks every rank whether its writer is done (one small all-reduce, :meth:`Checkpointer.poll`)
and, as soon as all are, rank 0 commits (renames into place, points ``latest`` at it); the
next save or the end of training also waits for a pending one. Every rank does this in the
same order.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from plugtron.core.checkpoint import layout, state, writer
from plugtron.core.errors import CheckpointError
from plugtron.core.monitoring import run_status


@dataclass
class PendingSave:
    iteration: int
    parent: str
    tmp_dir: str
    metadata: dict | None  # rank 0 only
    thread: threading.Thread | None
    error: BaseException | None = None
    started: float = 0.0
    blocked_s: float = 0.0


def _all_ok(run, ok: bool) -> bool:
    """Every rank's ``ok``, agreed over the world (a collective when there are several)."""
    if run.world.world_size == 1 or not dist.is_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32,
                        device="cuda" if run.world.device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


class Checkpointer:
    """One per run (``run.checkpointer``): saves and keeps the one pending async save."""

    def __init__(self, run):
        self.run = run
        self.pending: PendingSave | None = None
        self.last_saved: int | None = None
        self.start_iteration = run.state.iteration
        #: Seconds the training loop was blocked by each save (benchmarks read it).
        self.blocked_s: list[float] = []
        #: Host buffers that async snapshots copy into, reused from one save to the next (one
        #: copy of this rank's checkpoint tensors stays allocated, as in Megatron).
        self.staging: dict = {}

    @property
    def is_rank0(self) -> bool:
        return self.run.world.rank == 0

    def save(self, iteration: int | None = None, async_save: bool | None = None) -> None:
        """Save the run's state as iteration ``iteration`` (default: the current one) into
        ``--save``. Collective: every rank calls it."""
        run = self.run
        parent = run.config.checkpoint.save
        if not parent:
            raise CheckpointError("saving needs --save DIR")
        async_save = run.config.checkpoint.async_save if async_save is None else async_save
        iteration = run.state.iteration if iteration is None else iteration
        start = time.perf_counter()
        self.wait()
        run_status.set_phase(f"saving checkpoint {iteration}")
        os.makedirs(parent, exist_ok=True)
        tmp_dir = os.path.join(parent, layout.tmp_dirname(iteration))
        snap, optimizer_state = state.snapshot(run, copy=async_save, staging=self.staging)
        if run.world.device.type == "cuda":
            torch.cuda.synchronize()  # the copies to pinned host memory were asynchronous
        metadata = (state.run_metadata(run, optimizer_state, iteration) if self.is_rank0
                    else None)
        job = PendingSave(iteration, parent, tmp_dir, metadata, None, started=start)

        def write():
            try:
                writer.write_rank_files(tmp_dir, snap)
            except BaseException as exc:  # noqa: BLE001 - reported at commit, on every rank
                job.error = exc

        if async_save:
            job.thread = threading.Thread(target=write, name=f"checkpoint-{iteration}",
                                          daemon=True)
            job.thread.start()
            self.pending = job
            job.blocked_s = time.perf_counter() - start
        else:
            write()
            self.pending = job
            self.wait()
            job.blocked_s = time.perf_counter() - start
        self.blocked_s.append(job.blocked_s)
        self.last_saved = iteration

    def wait(self) -> str | None:
        """Finish the pending save: join its writer, agree that every rank succeeded, commit.
        Collective. Returns the committed path (None when nothing was pending)."""
        job, self.pending = self.pending, None
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()
        if not _all_ok(self.run, job.error is None):
            detail = f": {type(job.error).__name__}: {job.error}" if job.error else \
                " on another rank"
            raise CheckpointError(f"saving checkpoint iteration {job.iteration} into "
                                  f"{job.parent} failed{detail}; the previous checkpoint is "
                                  f"untouched")
        error = None
        final = os.path.join(job.parent, layout.iteration_dirname(job.iteration))
        if self.is_rank0:
            try:
                ranks = list(range(self.run.world.world_size))
                final = writer.commit(job.parent, job.tmp_dir, job.iteration,
                                      job.metadata or {}, ranks)
            except OSError as exc:
                error = exc
        if not _all_ok(self.run, error is None):
            raise CheckpointError(f"committing checkpoint iteration {job.iteration} into "
                                  f"{job.parent} failed: {error or 'on rank 0'}")
        if self.is_rank0:
            took = time.perf_counter() - job.started
            print(f"saved checkpoint iteration {job.iteration} to {final} "
                  f"({took:.2f} s, loop blocked {job.blocked_s:.2f} s)", flush=True)
        self.run.pm.hook.plugtron_checkpoint_saved(iteration=job.iteration, path=final)
        return final

    def poll(self) -> None:
        """Between steps: commit a pending async save as soon as every rank's background write
        has finished, not at the next save (a crash in between would discard it). One small
        all-reduce per step while a save is pending."""
        job = self.pending
        if job is None or job.thread is None:
            return
        if _all_ok(self.run, not job.thread.is_alive()):
            self.wait()

    def abandon(self) -> None:
        """On an error path: let the writer thread finish its files but commit nothing (no
        collectives: other ranks may be gone). The previous checkpoint stays the latest."""
        job, self.pending = self.pending, None
        if job is not None and job.thread is not None:
            job.thread.join()
