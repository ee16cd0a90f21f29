"""Put on PYTHONPATH by tests/reliability/test_exit.py: a fault in one rank's exit, after the
rank has finished. ``PLUGTRON_TEST_EXIT_FAULT=RANK:delay:SECONDS`` makes rank RANK wait that
long before it exits (its peers have exited by then); ``RANK:abort`` makes it die by SIGABRT
instead of exiting, as the old race did. Only processes with that RANK are touched, and only
their final ``os._exit``: the launcher and every other rank run as usual."""

import os
import signal
import time

_fault = os.environ.get("PLUGTRON_TEST_EXIT_FAULT", "")
if _fault and _fault.split(":")[0] == os.environ.get("RANK"):
    _real_exit = os._exit

    def _faulty_exit(code, _how=_fault.split(":")[1:]):
        if _how[0] == "delay":
            time.sleep(float(_how[1]))
        elif _how[0] == "abort":
            os.kill(os.getpid(), signal.SIGABRT)
        _real_exit(code)

    os._exit = _faulty_exit
