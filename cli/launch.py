"""Starting ranks: in this process, or N local ranks through torch.distributed.run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from plugtron.core.errors import PlugtronError
from plugtron.core.monitoring import run_status

from .failure_report import how_it_ended
from .rank_reaper import RankReaper, children

ERROR_FILE_ENV = "PLUGTRON_ERROR_FILE"


class JobStopped(Exception):
    """Every rank stopped cleanly on a signal or exit limit: message and exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _signal_all(sig: int) -> None:
    for pid in children(os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class _Signals:
    """The launcher's stop signals: the first one is passed on to every rank, which stops
    cleanly (ranks run in sessions of their own and do not see a terminal's Ctrl-C); a second
    SIGINT kills them all at once (not one within a second of the first: the same stop sent to
    every process of the job, preemption.is_abort)."""

    def __init__(self):
        from plugtron.core.training.preemption import (
            is_abort,  # imported here, never in the handler
        )

        self.is_abort = is_abort
        self.received = None
        self.received_at = 0.0

    def __call__(self, signum, frame):
        if self.received is not None:
            if self.is_abort(signum, self.received_at):
                _signal_all(signal.SIGKILL)
                os._exit(128 + signal.SIGINT)
            return
        self.received, self.received_at = signum, time.monotonic()
        _signal_all(signal.SIGCONT)  # a stopped rank must run to see it
        _signal_all(signum)


#: torchrun's own (public) option naming the signals its agent turns into an immediate kill of
#: the ranks. plugtron handles the stop signals itself (every rank finishes its step and
#: saves), so torch keeps only SIGQUIT (an abort). The grace after a failed rank is plugtron's
#: own (cli/rank_reaper.py), not torch's.
TORCHRUN_OPTIONS = {"--signals-to-handle": "SIGQUIT"}
FALLBACK_WARNING = ("plugtron: warning: this torch's launcher has no {missing} option: a stop "
                    "signal ends the ranks at once without a save")


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's ranks sit among several nodes (``plugtron train --nnodes``): every
    node's launcher starts its ``--nproc-per-node`` ranks and they meet at ``endpoint`` through
    torch elastic's c10d rendezvous (which also lets a failed group restart: ``max_restarts``).
    Global ranks are given node by node, so Megatron's order keeps tp inside a node."""

    count: int = 1
    rank: int = 0
    endpoint: str | None = None  # host:port of the rendezvous
    max_restarts: int = 0
    #: Elastic (``--nnodes MIN:MAX``): the fewest nodes a group may re-form with after a
    #: node is lost; ``count`` is the most. None: exactly ``count``.
    min_count: int | None = None
    #: ``--rdzv-conf``: the rendezvous's own settings, ((key, value), ...)
    rdzv_conf: tuple[tuple[str, str], ...] = ()

    @property
    def several(self) -> bool:
        return self.count > 1 or self.max_restarts > 0

    @property
    def nnodes(self) -> str:
        """torchrun's ``--nnodes``: ``N``, or ``MIN:MAX`` when elastic."""
        if self.min_count is None or self.min_count == self.count:
            return str(self.count)
        return f"{self.min_count}:{self.count}"

    def torchrun_options(self) -> list[str]:
        if not self.several:
            return ["--standalone"]
        # No --node-rank: the c10d rendezvous assigns node ranks itself (torch ignores it and
        # warns); plugtron's own --node-rank only says which launcher takes the save lock.
        # Elastic (MIN:MAX): once MIN nodes have joined, torch waits its last call (30 s) for
        # more, at the first start and after a node is lost, so slow starters are not left out
        # (--rdzv-conf last_call_timeout=S changes that wait).
        conf = ",".join(f"{key}={value}" for key, value in self.rdzv_conf)
        return [f"--nnodes={self.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id=plugtron-{self.endpoint}",
                *([f"--rdzv-conf={conf}"] if conf else [])]


def torchrun_argv(nproc: int, command: str, config_path: str, parser=None,
                  nodes: Nodes | None = None) -> tuple[list[str], str | None]:
    """torch.distributed.run's arguments, and a warning when this torch lacks the options
    plugtron relies on (an older or newer torch than the one it is tested with): the run then
    goes on with torch's own signal handling rather than failing."""
    if parser is None:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    known = {s for action in parser._actions for s in action.option_strings}
    extra, missing = [], []
    for option, value in TORCHRUN_OPTIONS.items():
        if option in known:
            extra.append(f"{option}={value}")
        else:
            missing.append(option)
    warning = FALLBACK_WARNING.format(missing=" or ".join(missing)) if missing else None
    nodes = nodes or Nodes()
    return ([*nodes.torchrun_options(), f"--nproc-per-node={nproc}",
             f"--max-restarts={nodes.max_restarts}", *extra,
             "-m", "plugtron.cli.rank", command, config_path], warning)


def launch_local_ranks(config_json: str, nproc: int, command: str = "train",
                       nodes: Nodes | None = None) -> None:
    """Run ``plugtron.cli.rank COMMAND`` (train or evaluate) on ``nproc`` local ranks; a user
    error raised in a rank comes back as ``PlugtronError`` with the rank's message, a failed
    rank as one report naming it (cli/failure_report.py), a clean stop as ``JobStopped``."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from .failure_report import report

    # The ranks print their own errors; the launcher's failure report would repeat them.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # Share the cores between the local ranks (and keep torchrun from warning about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    signals = _Signals()
    stop_signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    if json.loads(config_json).get("training", {}).get("exit_signal_handler"):
        stop_signals.append(signal.SIGUSR1)  # --exit-signal-handler: Slurm's warning signal
    for sig in stop_signals:
        signal.signal(sig, signals)

    with tempfile.TemporaryDirectory(prefix="plugtron-launch-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            f.write(config_json)
        error_file = os.path.join(tmp, "user_error.txt")
        status_dir = os.path.join(tmp, "status")
        os.makedirs(status_dir)
        os.environ[ERROR_FILE_ENV] = error_file
        os.environ[run_status.STATUS_DIR_ENV] = status_dir
        argv, warning = torchrun_argv(nproc, command, config_path, nodes=nodes)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        args = parse_args(argv)
        try:
            # With restarts, torch elastic itself stops a failed group and starts it again; the
            # reaper would kill the new attempt's ranks too.
            restarting = nodes is not None and nodes.max_restarts > 0
            with contextlib.nullcontext() if restarting else RankReaper(status_dir, error_file):
                run(args)
        except RendezvousError as exc:
            # The c10d rendezvous lives in the launcher at the endpoint (node 0's): when that
            # node is gone, no group can form again.
            where = nodes.endpoint if nodes is not None else "the rendezvous"
            raise RankFailure(f"lost the rendezvous at {where} ({type(exc).__name__}): the "
                              f"node whose launcher held it is gone, so the remaining nodes "
                              f"cannot form a group again; resume with --load from the "
                              f"latest checkpoint (an etcd rendezvous through torchrun "
                              f"survives the loss of any node)") from None
        except ChildFailedError as exc:
            late = _died_after_finishing(status_dir, nproc, exc)
            if late:  # every rank had finished (and saved): the run succeeded
                print(f"plugtron: note: {late}, after every rank had finished its work and "
                      f"the final checkpoint (if any) was committed; the run succeeded",
                      file=sys.stderr, flush=True)
            elif os.path.exists(error_file):
                with open(error_file) as f:
                    raise PlugtronError(f.read().strip()) from None
            else:
                codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
                if signals.received is not None and all(
                        c in (0, -signal.SIGTERM, -signal.SIGKILL) for c in codes.values()):
                    raise JobStopped(f"stopped by {signal.Signals(signals.received).name} "
                                     f"before the ranks could finish a step; nothing saved",
                                     128 + signals.received) from None
                raise RankFailure(report(status_dir, nproc, codes)) from None
        finally:
            os.environ.pop(ERROR_FILE_ENV, None)
            os.environ.pop(run_status.STATUS_DIR_ENV, None)
        stop = run_status.read(status_dir, 0, "phase") or ""
        if stop.startswith("stopped "):
            _, code, message = stop.split(" ", 2)
            raise JobStopped(message, int(code))


def _died_after_finishing(status_dir: str, nproc: int, exc) -> str | None:
    """When every local rank recorded a final phase (``done``, or ``stopped`` after its
    checkpoint) before one of them died, what died and how; None otherwise. The work and the
    saves are complete then: only the process's exit failed."""
    phases = [name for name in os.listdir(status_dir) if name.endswith(".phase")]
    if len(phases) < nproc:
        return None
    for name in phases:
        with open(os.path.join(status_dir, name)) as f:
            phase = f.read().strip()
        if phase != "done" and not phase.startswith("stopped "):
            return None
    return "; ".join(f"rank {rank} {how_it_ended(failure.exitcode)} while exiting"
                     for rank, failure in sorted(exc.failures.items()))


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
