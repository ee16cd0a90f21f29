"""After a rank fails, the others get a short grace, then SIGKILL.

A rank that fails leaves its peers waiting in a collective (until --distributed-timeout-minutes)
or frozen (SIGSTOP). torch's agent does end them, but with a grace of 30 s that its public
``--shutdown-timeout`` does not reach on this path (its ``_stop_workers`` uses the default), and
a frozen rank does not see the SIGTERM of that grace anyway. So the launcher watches its ranks
itself, with nothing but /proc and the ranks' status files (core/monitoring/run_status.py): once a rank
has failed (an error file, or the process gone in a phase other than done/stopped), the ones
still alive are killed after :data:`GRACE_S`. A run that ends cleanly never trips it: every
rank records ``done`` or ``stopped`` before it leaves.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from plugtron.core.monitoring import run_status

GRACE_S = 5.0
POLL_S = 0.2


def children(parent: int) -> list[int]:
    """Pids of ``parent``'s children, from /proc (empty where there is no /proc)."""
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"plugtron.cli.rank" not in f.read():
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class RankReaper:
    """``with RankReaper(status_dir, error_file):`` around the launch."""

    def __init__(self, status_dir: str, error_file: str, grace_s: float = GRACE_S):
        self.status_dir, self.error_file, self.grace_s = status_dir, error_file, grace_s
        self.ranks: dict[int, int] = {}  # rank -> pid, as they appear
        self.killed: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="plugtron-reaper", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(2)

    def failed(self) -> bool:
        if os.path.exists(self.error_file):
            return True
        for rank, pid in self.ranks.items():
            if run_status.read(self.status_dir, rank, "error") is not None:
                return True
            phase = run_status.read(self.status_dir, rank, "phase") or ""
            if not _alive(pid) and not (phase == "done" or phase.startswith("stopped")):
                return True
        return False

    def _watch(self) -> None:
        deadline = None
        while not self._done.wait(POLL_S):
            for pid in children(os.getpid()):
                if pid not in self.ranks.values():
                    rank = _rank_of(pid)
                    if rank is not None:
                        self.ranks[rank] = pid
            if deadline is None:
                if self.failed():
                    deadline = time.monotonic() + self.grace_s
            elif time.monotonic() >= deadline:
                for pid in self.ranks.values():
                    if _alive(pid):
                        try:
                            os.kill(pid, signal.SIGKILL)
                            self.killed.append(pid)
                        except ProcessLookupError:
                            pass
                return
