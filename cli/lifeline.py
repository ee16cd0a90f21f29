"""A rank dies with its launcher, whatever killed the launcher.

``kill -9`` of the launcher, of its process group, or the OOM killer leave no chance to stop
the workers (torch starts each in a session of its own). On Linux the kernel delivers SIGKILL
to a rank whose parent exits (``prctl(PR_SET_PDEATHSIG)``); elsewhere, and as a second line, a
watchdog thread sees the parent change and exits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def tie_to_parent() -> None:
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent or parent == 1:  # it died before the prctl took effect
        os._exit(1)

    def watch():
        while True:
            time.sleep(POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="plugtron-lifeline", daemon=True).start()
