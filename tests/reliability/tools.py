"""Helpers of the fault tests: real `plugtron` processes, bounded in time, with their exit
status, output and peak memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.utils import TINY

PYTHON = sys.executable
#: Every fault test process is killed after this many seconds: a hang is a failure, not a stall.
HARD_TIMEOUT_S = 90


def tiny_flags(**overrides) -> list[str]:
    """The tiny test model as `plugtron train` flags."""
    values = {**TINY, **{k.replace("_", "-"): v for k, v in overrides.items()}}
    out = []
    for key, value in values.items():
        if key == "progress":
            out.append("--progress" if value else "--no-progress")
        elif value is True:
            out.append(f"--{key}")
        elif value is not None and value is not False:
            out += [f"--{key}", str(value)]
    return out


def plugtron_argv(*args) -> list[str]:
    return [PYTHON, "-m", "plugtron.cli.main", *args]


@dataclass
class Finished:
    rc: int  # exit code, or -signal
    out: str
    seconds: float
    timed_out: bool = False


def run_cli(args, timeout: float = HARD_TIMEOUT_S, env=None, cwd=None) -> Finished:
    """Run `plugtron ARGS` to the end (killed, with its group, after ``timeout``)."""
    proc = start_cli(args, env=env, cwd=cwd)
    return finish(proc, timeout)


def start_cli(args, env=None, cwd=None, argv=None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(argv or plugtron_argv(*args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=full_env, cwd=cwd,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = HARD_TIMEOUT_S) -> Finished:
    """Wait for ``proc`` (its output read meanwhile); kill its process group on timeout."""
    start = time.monotonic()
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        out, _ = proc.communicate()
    return Finished(proc.returncode, out, time.monotonic() - start, timed_out)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def losses_of(metrics) -> dict[int, float]:
    """``{iteration: lm_loss}`` of a metrics file (a later line for an iteration wins: a resumed
    run rewrites the iterations after its checkpoint)."""
    import json

    out = {}
    with open(metrics) as f:
        for line in f:
            record = json.loads(line)
            if "lm_loss" in record and "iteration" in record:
                out[record["iteration"]] = record["lm_loss"]
    return out
