"""torch elastic restarts a failed worker group and the run resumes with nothing lost: under
``torchrun --max-restarts 1 --rdzv-backend c10d``, and under ``plugtron train --nproc-per-node 2
--max-restarts 1`` (which runs torch elastic that way), with ``--save D --load D``, rank 1 SIGKILLed
mid-run; the restarted group joins the world (each attempt has store keys of its own,
core/parallel/distributed.py: restart_store), resumes from the latest checkpoint and ends with the
uninterrupted run's losses and final checkpoint, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch
from plugtron.core.checkpoint import CheckpointReader

from .procs import ranks_of
from .tools import (
    HARD_TIMEOUT_S,
    finish,
    losses_of,
    plugtron_argv,
    run_cli,
    start_cli,
    tiny_flags,
    wait_for,
)

ITERS = 12
FLAGS = tiny_flags(train_iters=ITERS, save_interval=2, log_interval=1, eval_interval=0)


def _torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args,
            "-m", "plugtron.cli.main"]


def _iterations(metrics: str) -> int:
    try:
        return len(losses_of(metrics))
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole")
    done = run_cli(["train", *FLAGS, "--save", str(path / "ckpt"), "--metrics-file",
                    str(path / "m.jsonl"), "--nproc-per-node", "2"])
    assert done.rc == 0, done.out
    return str(path / "ckpt"), losses_of(str(path / "m.jsonl"))


def _launch(launcher: str, save: str, metrics: str) -> list[str]:
    train = ["train", *FLAGS, "--save", save, "--load", save, "--metrics-file", metrics]
    if launcher == "torchrun":
        return _torchrun("--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                         "127.0.0.1:0") + train
    return plugtron_argv(*train, "--nproc-per-node", "2", "--max-restarts", "1")


@pytest.mark.parametrize("launcher", ["torchrun", "plugtron"])
def test_a_killed_rank_restarts_and_resumes_bitwise(tmp_path, whole, launcher):
    save, metrics = str(tmp_path / "elastic"), str(tmp_path / "elastic.jsonl")
    proc = start_cli([], argv=_launch(launcher, save, metrics))
    try:
        assert wait_for(lambda: _iterations(metrics) >= 5 or proc.poll() is not None, 60)
        victim = ranks_of(proc.pid, b"plugtron.cli").get(1)
        assert proc.poll() is None and victim is not None, "the run did not start training"
        os.kill(victim, signal.SIGKILL)
        done = finish(proc, HARD_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert done.rc == 0 and not done.timed_out, done.out
    assert "loaded checkpoint" in done.out  # the second attempt resumed
    starts = [r for r in map(json.loads, open(metrics)) if "elastic_restart" in r]
    assert len(starts) == 1 and starts[0]["elastic_restart"] == 1, starts  # where it restarted
    assert 2 <= starts[0]["resumed_from_iteration"] < ITERS, starts
    whole_save, want = whole
    got = losses_of(metrics)  # both attempts append; the resumed one rewrites iterations
    assert sorted(got) == sorted(want)
    for i in want:
        assert got[i] == want[i], i
    ours, theirs = CheckpointReader(save), CheckpointReader(whole_save)
    assert ours.iteration == theirs.iteration == ITERS
    for name in theirs.tensors:
        if name.startswith("model/"):
            assert torch.equal(ours.read_full(name), theirs.read_full(name)), name
