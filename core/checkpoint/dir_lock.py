"""One run per save directory, and the directory put in order when a run takes it.

The lock is ``SAVE/.lock`` held with ``flock`` for the run's lifetime by the process that
starts the run (plugtron's launcher, or rank 0 under an external launcher). The kernel drops
the lock when its holder dies, however it died, so a stale lock of a dead process is simply
taken over; the file's text (host, pid) only names the holder in the refusal. ``flock`` is
not reliable on some network file systems (docs/reliability.md).

Taking the lock also repairs what crashed saves left behind (:func:`recover`).
"""

from __future__ import annotations

import os
import shutil
import socket

from ..errors import CheckpointError
from . import layout

LOCK = ".lock"
_held: dict[str, int] = {}  # save dir -> fd of the held lock (kept open for the process)


def acquire(save: str) -> None:
    """Lock ``save`` for this process; ``CheckpointError`` naming the holder if another
    process holds it."""
    import fcntl

    path = os.path.abspath(save)
    if path in _held:
        return
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(f"--save {save!r} is in use by {holder}; two runs must not save "
                              f"into one directory (wait for it, or choose another --save)"
                              ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    _held[path] = fd
    recover(path)


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
        from .writer import write_latest

        # The newest complete one not newer than what ``latest`` named: never another run's.
        named = layout.iteration_of(latest)
        found = [(i, p) for i, p in layout.complete_checkpoints(parent)
                 if named is None or i <= named]
        if found:
            write_latest(parent, os.path.basename(found[-1][1]))
        else:
            os.remove(os.path.join(parent, layout.LATEST))
