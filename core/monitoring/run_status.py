"""What each rank is doing, left where its launcher can read it after the rank is gone.

Under plugtron's launcher every rank keeps one small file in ``$PLUGTRON_STATUS_DIR``:
``rank_00003.phase`` holds its current phase (``setup``, ``step 12``, ``saving checkpoint 10``,
``evaluating``, ``stopping``) and ``rank_00003.error`` the traceback of an unexpected error. A
rank killed by a signal cannot say anything itself; its last phase can still be reported, and
the survivors' errors (a peer vanished) are told apart from the root cause.
"""

from __future__ import annotations

import os

STATUS_DIR_ENV = "PLUGTRON_STATUS_DIR"

_rank = int(os.environ.get("RANK", 0))


def _path(kind: str, rank: int | None = None) -> str | None:
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return None
    return os.path.join(directory, f"rank_{_rank if rank is None else rank:05d}.{kind}")


def set_phase(phase: str) -> None:
    """Record this rank's phase (a rename, so a reader never sees half a line)."""
    path = _path("phase")
    if path is None:
        return
    try:
        with open(path + ".tmp", "w") as f:
            f.write(phase)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # status is best effort: never the reason a run fails


def write_error(text: str) -> None:
    path = _path("error")
    if path is not None:
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError:
            pass


def read(directory: str, rank: int, kind: str) -> str | None:
    try:
        with open(os.path.join(directory, f"rank_{rank:05d}.{kind}")) as f:
            return f.read().strip()
    except OSError:
        return None
