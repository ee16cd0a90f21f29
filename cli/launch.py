"""Starting ranks: in this process, or N local ranks through torch.distributed.run."""

from __future__ import annotations

import os
import signal
import sys
import tempfile

from plugtron.core import run_status
from plugtron.core.errors import PlugtronError

ERROR_FILE_ENV = "PLUGTRON_ERROR_FILE"


class JobStopped(Exception):
    """Every rank stopped cleanly on a signal or exit limit: message and exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _children() -> list[int]:
    """Pids of this process's children (the ranks), from /proc."""
    me, out = os.getpid(), []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _signal_all(sig: int) -> None:
    for pid in _children():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class _Signals:
    """The launcher's stop signals: the first one is passed on to every rank, which stops
    cleanly (ranks run in sessions of their own and do not see a terminal's Ctrl-C); a second
    SIGINT kills them all at once."""

    def __init__(self):
        self.received = None

    def __call__(self, signum, frame):
        if self.received is not None:
            if signum == signal.SIGINT:
                _signal_all(signal.SIGKILL)
                os._exit(128 + signal.SIGINT)
            return
        self.received = signum
        _signal_all(signal.SIGCONT)  # a stopped rank must run to see it
        _signal_all(signum)


def _patch_torch_elastic(handler) -> None:
    """torch.distributed.run installs its own handlers (which kill the ranks at once) when it
    starts them; put ours in their place, and shorten its 30 s grace when it ends ranks after
    a failure."""
    from torch.distributed.elastic.multiprocessing import api

    api._terminate_process_handler = handler
    if not getattr(api.PContext.close, "_plugtron", False):
        original = api.PContext.close

        def close(self, death_sig=None, timeout=5):
            # A frozen (SIGSTOPped) rank is not woken: it would report a timeout of its own
            # and hide that it never arrived; SIGKILL after the grace ends it anyway.
            return original(self, death_sig, min(timeout, 5))

        close._plugtron = True
        api.PContext.close = close


def launch_local_ranks(config_json: str, nproc: int, command: str = "train") -> None:
    """Run ``plugtron.cli.rank COMMAND`` (train or evaluate) on ``nproc`` local ranks; a user
    error raised in a rank comes back as ``PlugtronError`` with the rank's message, a failed
    rank as one report naming it (cli/failure_report.py), a clean stop as ``JobStopped``."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .failure_report import report

    # The ranks print their own errors; the launcher's failure report would repeat them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # Share the cores between the local ranks (and keep torchrun from warning about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    signals = _Signals()
    _patch_torch_elastic(signals)

    with tempfile.TemporaryDirectory(prefix="plugtron-launch-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            f.write(config_json)
        error_file = os.path.join(tmp, "user_error.txt")
        status_dir = os.path.join(tmp, "status")
        os.makedirs(status_dir)
        os.environ[ERROR_FILE_ENV] = error_file
        os.environ[run_status.STATUS_DIR_ENV] = status_dir
        args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
                           "-m", "plugtron.cli.rank", command, config_path])
        try:
            run(args)
        except ChildFailedError as exc:
            if os.path.exists(error_file):
                with open(error_file) as f:
                    raise PlugtronError(f.read().strip()) from None
            codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
            if signals.received is not None and all(c in (0, -signal.SIGTERM, -signal.SIGKILL)
                                                    for c in codes.values()):
                raise JobStopped(f"stopped by {signal.Signals(signals.received).name} before "
                                 f"the ranks could finish a step; nothing saved",
                                 128 + signals.received) from None
            raise RankFailure(report(status_dir, nproc, codes)) from None
        finally:
            os.environ.pop(ERROR_FILE_ENV, None)
            os.environ.pop(run_status.STATUS_DIR_ENV, None)
        stop = run_status.read(status_dir, 0, "phase") or ""
        if stop.startswith("stopped "):
            _, code, message = stop.split(" ", 2)
            raise JobStopped(message, int(code))


class RankFailure(Exception):
    """A rank died or failed; the message is the launcher's report (exit 1)."""


def report_user_error(message: str) -> None:
    """Called in a rank: leave the message for the launcher (first writer wins)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path and not os.path.exists(path):
        try:
            with open(path, "x") as f:
                f.write(message)
        except FileExistsError:
            pass
    if not path:  # under torchrun: nobody else prints it; under plugtron's launcher, it does
        print(f"Error: {message}", file=sys.stderr, flush=True)
