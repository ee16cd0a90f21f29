"""One run per save directory, and the directory put in order when a run takes it.

The lock is ``SAVE/.lock`` held with ``flock`` for the run's lifetime. Every way into a run
takes it: ``pretrain()`` itself (:func:`hold_for_run`, rank 0 of the world), so a run started
from Python holds it as one started by the CLI; the CLI takes it earlier, before any rank
starts, so that a second run is refused in seconds. plugtron's launcher holds it for its
ranks: it names its lock in ``PLUGTRON_SAVE_LOCK`` and its child rank 0 then counts it as held
(an flock held by the parent conflicts with the child's own otherwise). The kernel drops the
lock when its holder dies, however it died, so a stale lock of a dead process is simply taken
over; the file's text (host, pid) only names the holder in the refusal. ``flock`` is not
reliable on some network file systems (docs/reliability.md).

Taking the lock also repairs what crashed saves left behind (:func:`recover`).
"""

from __future__ import annotations

import os
import shutil
import socket

import torch
from plugtron.core.checkpoint import layout
from plugtron.core.checkpoint.writer import write_latest
from plugtron.core.errors import CheckpointError

LOCK = ".lock"
#: Set by plugtron's launcher for its ranks: the save directory whose lock it holds for them.
INHERITED_ENV = "PLUGTRON_SAVE_LOCK"
_held: dict[str, int] = {}  # save dir -> fd of the held lock (kept open for the process)


def _holder_text() -> str:
    return f"pid {os.getpid()} on host {socket.gethostname()}"


def _held_by_launcher(path: str, text: str) -> bool:
    """The lock is our launcher's, taken for this run: it named the directory for us and the
    file names our parent on our host."""
    if os.environ.get(INHERITED_ENV) != path:
        return False
    return text == f"pid {os.getppid()} on host {socket.gethostname()}"


def holder(save: str) -> str:
    """Who the lock file names (for refusals on ranks that did not try the lock)."""
    try:
        with open(os.path.join(os.path.abspath(save), LOCK)) as f:
            return f.read(200).strip() or "another process"
    except OSError:
        return "another process"


def refusal(save: str, holder_text: str) -> CheckpointError:
    return CheckpointError(f"--save {save!r} is in use by {holder_text}; two runs must not save "
                           f"into one directory (wait for it, or choose another --save)")


def acquire(save: str) -> bool:
    """Lock ``save`` for this process; ``CheckpointError`` naming the holder if another
    process holds it. True when this call took the lock (the caller releases it), False when
    this process (or the launcher of this rank) already held it."""
    import fcntl  # noqa: PLC0415 - POSIX only: imported where the lock is taken
    path = os.path.abspath(save)
    if path in _held:
        return False
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if _held_by_launcher(path, text):
            return False
        raise refusal(save, text) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{_holder_text()}\n".encode(), 0)
    _held[path] = fd
    recover(path)
    return True


def hold_for_run(save: str | None, rank: int, world_size: int, device=None) -> bool:
    """Called by every rank where a run opens its save directory (``pretrain``): one rank
    takes the lock (and repairs crashed saves) while the others wait, then all agree, so a
    refusal stops every rank with the same CheckpointError and nobody reads the directory before
    it is repaired. True when this rank took the lock (release it at the run's end).

    The rank that tries is rank 0, unless a plugtron launcher holds the lock for the run: then
    the first local rank under that launcher (it checks the lock is its parent's). With several
    nodes that launcher is ``--node-rank 0``'s, and the rendezvous may place global rank 0 on
    another node, where the lock is not held by its parent."""

    if not save:
        return False
    under_launcher = os.environ.get(INHERITED_ENV) == os.path.abspath(save)
    any_launcher = under_launcher
    distributed = world_size > 1 and torch.distributed.is_initialized()
    if distributed:
        flag = torch.tensor([int(under_launcher)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        any_launcher = bool(int(flag[0]))
    if any_launcher:
        tries = under_launcher and int(os.environ.get("LOCAL_RANK", 0)) == 0
    else:
        tries = rank == 0
    took, error = False, None
    if tries:
        try:
            took = acquire(save)
        except CheckpointError as exc:
            error = exc
    if distributed:
        flag = torch.tensor([0 if error is None else 1], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if error is None and int(flag[0]):
            error = refusal(save, holder(save))
    if error is not None:
        raise error
    return took


def release(save: str) -> None:
    fd = _held.pop(os.path.abspath(save), None)
    if fd is not None:
        os.close(fd)


def recover(parent: str) -> None:
    """After a crash: remove temporary directories of interrupted saves, put back an old copy
    that a crashed re-save had moved aside, and make ``latest`` name a complete checkpoint."""
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(layout.TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif ".old-" in name and name.startswith("iter_"):
            final = os.path.join(parent, name.split(".old-")[0])
            if not layout.is_checkpoint(final) and layout.is_checkpoint(path):
                if os.path.isdir(final):
                    shutil.rmtree(final, ignore_errors=True)
                os.rename(path, final)
            else:
                shutil.rmtree(path, ignore_errors=True)
    latest = layout.read_latest(parent)
    if latest is not None and not layout.is_checkpoint(os.path.join(parent, latest)):

        # The newest complete one not newer than what ``latest`` named: never another run's.
        named = layout.iteration_of(latest)
        found = [(i, p) for i, p in layout.complete_checkpoints(parent)
                 if named is None or i <= named]
        if found:
            write_latest(parent, os.path.basename(found[-1][1]))
        else:
            os.remove(os.path.join(parent, layout.LATEST))
