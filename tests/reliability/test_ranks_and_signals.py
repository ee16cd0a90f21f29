"""Real faults on real `plugtron train` processes: the launcher killed, a rank killed mid-step
and mid-save, a rank frozen (SIGSTOP) under --distributed-timeout-minutes, SIGTERM/SIGINT
preemption on one and two ranks, a second SIGINT. Every process is bounded in time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from .procs import ranks_of
from .tools import finish, kill_group, pid_alive, start_cli, tiny_flags, wait_for

LONG = tiny_flags(train_iters=100000, lr_warmup_iters=1)


def _start(tmp_path, *extra, nproc=2, env=None):
    metrics = str(tmp_path / "metrics.jsonl")
    args = ["train", *LONG, "--metrics-file", metrics, *extra]
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc)]
    proc = start_cli(args, env=env)
    return proc, metrics


def _steps(metrics: str) -> int:
    try:
        with open(metrics) as f:
            return sum(1 for line in f if '"iteration"' in line)
    except OSError:
        return 0


def _wait_training(proc, metrics, steps=2, timeout=60):
    ok = wait_for(lambda: _steps(metrics) >= steps or proc.poll() is not None, timeout)
    assert ok and proc.poll() is None, "the run did not start training"


@pytest.mark.parametrize("how", ["pid", "group"])
def test_ranks_die_with_their_launcher(tmp_path, how):
    proc, metrics = _start(tmp_path)
    try:
        _wait_training(proc, metrics)
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 2
        start = time.monotonic()
        if how == "pid":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        gone = wait_for(lambda: not any(pid_alive(p) for p in ranks.values()), 5)
        took = time.monotonic() - start
        assert gone, f"ranks still alive {took:.1f} s after kill -9 of the launcher"
        print(f"ranks gone {took:.2f} s after kill -9 ({how})")
    finally:
        kill_group(proc.pid)
        finish(proc, 10)


def test_rank_killed_mid_step_is_named(tmp_path):
    proc, metrics = _start(tmp_path)
    _wait_training(proc, metrics)
    os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)
    done = finish(proc, 60)
    assert done.rc == 1, done.out
    assert "rank 1 was killed by SIGKILL during 'step" in done.out, done.out
    assert "Traceback" not in done.out, done.out


def intact(save: str, iteration: int) -> None:
    """``latest`` names ``iteration`` and that checkpoint loads, every file against its CRC."""
    from plugtron.core.checkpoint import CheckpointReader

    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == f"iter_{iteration:07d}"
    reader = CheckpointReader(save)
    assert reader.iteration == iteration
    reader.verify_all()


def test_rank_killed_mid_save_is_named(tmp_path):
    """kill -9 of rank 1 while checkpoint 4 is written: the job names it, and checkpoint 2
    (committed before) and `latest` are intact and load."""
    save = str(tmp_path / "save")
    proc, metrics = _start(tmp_path, "--save", save, "--save-interval", "2",
                           env={"PLUGTRON_CHECKPOINT_TEST_FILE_DELAY": "0.7"})
    assert wait_for(lambda: os.path.isdir(os.path.join(save, ".tmp-iter_0000004")), 60)
    os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)
    done = finish(proc, 60)
    assert done.rc == 1, done.out
    assert "rank 1 was killed by SIGKILL during 'saving checkpoint 4'" in done.out, done.out
    assert "Traceback" not in done.out
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    intact(save, 2)


def test_frozen_rank_hits_the_distributed_timeout(tmp_path):
    proc, metrics = _start(tmp_path, "--distributed-timeout-minutes", "0.1")
    _wait_training(proc, metrics)
    frozen = ranks_of(proc.pid)[1]
    os.kill(frozen, signal.SIGSTOP)
    start = time.monotonic()
    try:
        done = finish(proc, 60)
    finally:
        if pid_alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    took = time.monotonic() - start
    assert done.rc == 1, done.out
    assert "--distributed-timeout-minutes expired" in done.out, done.out
    assert "rank(s) 1 did not arrive" in done.out and "waited in" in done.out, done.out
    assert "Traceback" not in done.out
    assert took < 30, took


# The first complaint, SIGTERM on one process, and SIGINT there; SIGINT, SIGTERM and
# SIGHUP through plugtron's launcher on two ranks (SIGINT the way a scheduler sends it: to
# every process of the job, so each rank gets it twice within milliseconds, directly and
# forwarded, which must count as one stop); SIGUSR1 with --exit-signal-handler on one.
@pytest.mark.parametrize("nproc,sig,to_all", [
    (1, signal.SIGTERM, False), (1, signal.SIGINT, False), (2, signal.SIGINT, True),
    (2, signal.SIGTERM, False), (2, signal.SIGHUP, False), (1, signal.SIGUSR1, False)])
def test_preemption_saves_and_exits_with_one_line(tmp_path, nproc, sig, to_all):
    save = str(tmp_path / "save")
    # SIGUSR1 (Slurm's warning signal) stops cleanly only with Megatron's --exit-signal-handler.
    extra = ["--exit-signal-handler"] if sig == signal.SIGUSR1 else []
    proc, metrics = _start(tmp_path, "--save", save, *extra, nproc=nproc)
    _wait_training(proc, metrics, steps=1)
    targets = [proc.pid] + (list(ranks_of(proc.pid).values()) if to_all else [])
    assert len(targets) == (3 if to_all else 1)
    for pid in targets:
        os.kill(pid, sig)
    done = finish(proc, 60)
    assert done.rc == 128 + sig, done.out
    name = signal.Signals(sig).name
    lines = [line for line in done.out.splitlines() if "stopped by" in line]
    assert len(lines) == 1 and name in lines[0] and "checkpoint saved" in lines[0], done.out
    assert "Traceback" not in done.out
    iteration = int(lines[0].split("after iteration ")[1].split(";")[0])
    intact(save, iteration)


def test_sigterm_is_answered_by_the_save_alone(tmp_path):
    """A scheduler's deadline: after SIGTERM the run finishes its step and saves; it runs no
    validation (here one after every step, and another at the end of an unaligned run)."""
    save = str(tmp_path / "save")
    proc, metrics = _start(tmp_path, "--save", save, "--eval-interval", "1", "--eval-iters", "2",
                           nproc=1)
    _wait_training(proc, metrics, steps=2)
    os.kill(proc.pid, signal.SIGTERM)
    done = finish(proc, 60)
    assert done.rc == 128 + signal.SIGTERM, done.out
    line = next(line for line in done.out.splitlines() if "stopped by SIGTERM" in line)
    stop = int(line.split("after iteration ")[1].split(";")[0])
    with open(metrics) as f:
        records = [json.loads(text) for text in f if text.strip()]
    evaluated = [r["iteration"] for r in records if any(k.startswith("valid_") for k in r)]
    assert evaluated and max(evaluated) < stop, (evaluated, stop)  # none at or after the stop
    intact(save, stop)


def test_second_sigint_aborts_at_once(tmp_path, saved_run):
    """Two ranks through the launcher: the first SIGINT starts the clean stop, whose save is
    slowed to 30 s per file; a second SIGINT (more than preemption.ABORT_AFTER_S later) kills
    every rank at once. Nothing of the cut save is committed; the earlier checkpoint stays
    the latest and loads."""
    save = str(tmp_path / "save")
    shutil.copytree(saved_run[0], save)
    proc, metrics = _start(tmp_path, "--save", save, "--load", save, nproc=2,
                           env={"PLUGTRON_CHECKPOINT_TEST_FILE_DELAY": "30"})
    try:
        _wait_training(proc, metrics, steps=1)
        ranks = ranks_of(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        first = time.monotonic()
        assert wait_for(lambda: any(n.startswith(".tmp-") for n in os.listdir(save)), 30)
        # A second SIGINT within a second of the first is the same stop delivered twice.
        wait_for(lambda: time.monotonic() - first > 1.2, 2)
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        done = finish(proc, 20)
        took = time.monotonic() - start
        assert done.rc == 130 and took < 5, (took, done.out)
        assert "Traceback" not in done.out
        assert wait_for(lambda: not any(pid_alive(p) for p in ranks.values()), 5)
    finally:
        kill_group(proc.pid)
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002"]
    intact(save, 2)


def test_exit_duration_stops_every_rank_cleanly_and_saves(tmp_path):
    """Megatron's --exit-duration-in-mins (3 s here; agreed over the ranks, so all stop after
    the same step): exit 0, one line, the checkpoint of that iteration. (--exit-interval:
    test_save_directory.py::test_crashed_save_leftovers_removed_at_next_start.)"""
    save = str(tmp_path / "save")
    limit = ["--exit-duration-in-mins", "0.05"]
    proc, metrics = _start(tmp_path, "--save", save, *limit, nproc=2)
    done = finish(proc, 60)
    assert done.rc == 0 and not done.timed_out, done.out
    lines = [line for line in done.out.splitlines() if line.startswith("stopped after")]
    assert len(lines) == 1 and limit[0] in lines[0] and "checkpoint saved" in lines[0], done.out
    assert "Traceback" not in done.out
    iteration = int(lines[0].split("after iteration ")[1].split(":")[0])
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == f"iter_{iteration:07d}"
    assert _steps(metrics) == iteration
