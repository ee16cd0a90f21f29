"""Real faults on real `plugtron train` processes: the launcher killed, a rank killed mid-step
and mid-save, a rank frozen (SIGSTOP) under --distributed-timeout-minutes, SIGTERM/SIGINT
preemption on one and two ranks, a second SIGINT. Every process is bounded in time."""

from __future__ import annotations

import os
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


def test_rank_killed_mid_save_is_named(tmp_path):
    save = str(tmp_path / "save")
    proc, metrics = _start(tmp_path, "--save", save, "--save-interval", "2",
                           env={"PLUGTRON_CHECKPOINT_TEST_FILE_DELAY": "2"})
    assert wait_for(lambda: os.path.isdir(os.path.join(save, ".tmp-iter_0000002")), 60)
    os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)
    done = finish(proc, 60)
    assert done.rc == 1, done.out
    assert "rank 1 was killed by SIGKILL during 'saving checkpoint 2'" in done.out, done.out
    assert "Traceback" not in done.out


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


# Each signal once, SIGINT (Ctrl-C) on one rank, the rest through torchrun on two: the handler
# is the same code for every signal, what differs is how the signal reaches the ranks.
@pytest.mark.parametrize("nproc,sig", [(1, signal.SIGINT), (2, signal.SIGTERM),
                                       (2, signal.SIGHUP), (2, signal.SIGUSR1)])
def test_preemption_saves_and_exits_with_one_line(tmp_path, nproc, sig):
    save = str(tmp_path / "save")
    # SIGUSR1 (Slurm's warning signal) stops cleanly only with Megatron's --exit-signal-handler.
    extra = ["--exit-signal-handler"] if sig == signal.SIGUSR1 else []
    proc, metrics = _start(tmp_path, "--save", save, *extra, nproc=nproc)
    _wait_training(proc, metrics)
    os.kill(proc.pid, sig)
    done = finish(proc, 60)
    assert done.rc == 128 + sig, done.out
    name = signal.Signals(sig).name
    lines = [line for line in done.out.splitlines() if "stopped by" in line]
    assert len(lines) == 1 and name in lines[0] and "checkpoint saved" in lines[0], done.out
    assert "Traceback" not in done.out
    with open(os.path.join(save, "latest")) as f:
        latest = f.read().strip()
    iteration = int(lines[0].split("after iteration ")[1].split(";")[0])
    assert latest == f"iter_{iteration:07d}"


def test_second_sigint_aborts_at_once(tmp_path):
    save = str(tmp_path / "save")
    # Each checkpoint file takes 30 s to "write": the clean stop would take minutes.
    proc, metrics = _start(tmp_path, "--save", save, nproc=1,
                           env={"PLUGTRON_CHECKPOINT_TEST_FILE_DELAY": "30"})
    _wait_training(proc, metrics)
    os.kill(proc.pid, signal.SIGINT)
    assert wait_for(lambda: os.path.isdir(os.path.join(save, ".tmp-iter_" + "0" * 7))
                    or any(n.startswith(".tmp-") for n in os.listdir(save))
                    if os.path.isdir(save) else False, 30)
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    done = finish(proc, 20)
    assert done.rc == 130 and time.monotonic() - start < 5, done.out
    assert "Traceback" not in done.out


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
