"""Stopping a run cleanly: SIGTERM/SIGINT (preemption), ``--exit-duration-in-mins`` and
``--exit-interval``.

A signal only sets a flag; between two steps every rank asks :func:`check`, which agrees on the
flag over the world (one tiny all-reduce), so all ranks stop after the same iteration, save
(the normal end-of-training save) and exit. A second SIGINT aborts at once (exit 130),
unless it comes within :data:`ABORT_AFTER_S` of the first (the same stop, delivered twice). Exit
codes (README): 128 + signal number after a signal (SIGTERM 143, SIGINT 130), 0 for the
duration and interval limits.
"""

from __future__ import annotations

import os
import signal
import time

import torch

#: Signals that ask for a clean stop; --exit-signal-handler adds SIGUSR1 (Slurm's warning).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: A second SIGINT aborts only this long after the first stop signal: a scheduler that signals
#: every process of a job (launcher and ranks) makes each rank get SIGINT twice within
#: milliseconds (directly and forwarded by the launcher), which is one request to stop, not a
#: user pressing Ctrl-C again.
ABORT_AFTER_S = 1.0

_received: int | None = None
_received_at = 0.0
_started = time.monotonic()
#: Why the loop stopped early: (message, exit code), or None.
stopped: tuple[str, int] | None = None


def is_abort(signum: int, first_at: float) -> bool:
    """Whether ``signum``, arriving after a first stop signal received at ``first_at``
    (time.monotonic), aborts the run: a SIGINT at least :data:`ABORT_AFTER_S` later."""
    return signum == signal.SIGINT and time.monotonic() - first_at >= ABORT_AFTER_S


def _handler(signum, frame) -> None:
    global _received, _received_at
    if _received is not None:
        if is_abort(signum, _received_at):
            os._exit(128 + signal.SIGINT)  # the second Ctrl-C: abort now, no cleanup
        return
    _received, _received_at = signum, time.monotonic()


def begin_run() -> None:
    """A run starts (``pretrain``): an earlier run's stop in this process (a notebook, a sweep,
    a test pool's rank) is forgotten, and the signal that caused it with it (a signal not yet
    acted on stays); ``--exit-duration-in-mins`` counts from here, as Megatron's from the start
    of ``pretrain``. Without it a second run in one process stopped after its first step."""
    global stopped, _started, _received
    if stopped is not None and stopped[1] != 0:
        _received = None
    stopped, _started = None, time.monotonic()


def install(extra: bool = False) -> None:
    """Handle the stop signals in this process (main thread only)."""
    for sig in STOP_SIGNALS + ((signal.SIGUSR1,) if extra else ()):
        signal.signal(sig, _handler)


def request_stop(signum: int) -> None:
    """As if ``signum`` had arrived (tests, launchers)."""
    _handler(signum, None)


def check(run, iteration: int) -> bool:
    """Whether every rank stops after ``iteration``; sets :data:`stopped`. Collective over the
    world when it has several ranks."""
    global stopped
    t = run.config.training
    minutes = getattr(t, "exit_duration_in_mins", None)
    over_time = minutes is not None and minutes > 0 and \
        (time.monotonic() - _started) / 60 >= minutes
    flags = torch.tensor([_received or 0, int(over_time)], dtype=torch.int64)
    if run.world.world_size > 1 and torch.distributed.is_initialized():
        flags = flags.to(run.world.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        flags = flags.cpu()
    signum, over_time = int(flags[0]), bool(flags[1])
    interval = getattr(t, "exit_interval", None)
    if signum:
        name = signal.Signals(signum).name
        stopped = (f"stopped by {name} after iteration {iteration}", 128 + signum)
    elif over_time:
        stopped = (f"stopped after iteration {iteration}: --exit-duration-in-mins {minutes} "
                   f"reached", 0)
    elif interval and iteration % interval == 0:
        stopped = (f"stopped after iteration {iteration}: --exit-interval {interval}", 0)
    return stopped is not None


def by_signal() -> bool:
    """Whether the run stopped for a signal (a scheduler's deadline: nothing but the save may
    follow), not for --exit-interval or --exit-duration-in-mins."""
    return stopped is not None and stopped[1] != 0


def final_message(config) -> str:
    """The one line a stopped run ends with."""
    message = stopped[0] if stopped else "stopped"
    save = config.checkpoint.save
    return message + (f"; checkpoint saved in {save}" if save else "; nothing saved (no --save)")
