"""A finished run exits 0, whatever the order and timing of its ranks' exits.

The fault is injected into the ranks' last step, ``os._exit``, from outside plugtron (a
``sitecustomize`` on their path: tests/reliability/exit_faults/). benchmarks/exit_stress.py
runs the same exit 200 times on a saturated CPU.
"""

from __future__ import annotations

import os

from .tools import losses_of, run_cli, tiny_flags

FAULTS = os.path.join(os.path.dirname(__file__), "exit_faults")


def _run(tmp_path, fault: str):
    env = {"PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
           "PLUGTRON_TEST_EXIT_FAULT": fault}
    metrics = str(tmp_path / "metrics.jsonl")
    save = str(tmp_path / "ckpt")
    result = run_cli(["train", *tiny_flags(train_iters=2), "--nproc-per-node", "2",
                      "--metrics-file", metrics, "--save", save], env=env)
    return result, metrics, save


def test_a_rank_that_exits_late_still_gives_exit_0(tmp_path):
    result, metrics, _ = _run(tmp_path, "1:delay:3")
    assert result.rc == 0, result.out
    assert result.seconds > 3  # the launcher waited for the late rank
    assert "note:" not in result.out
    assert sorted(losses_of(metrics)) == [1, 2]


def test_a_rank_that_dies_after_finishing_is_named_and_the_run_succeeds(tmp_path):
    from plugtron.core.checkpoint import CheckpointReader

    result, metrics, save = _run(tmp_path, "1:abort")
    assert result.rc == 0, result.out
    assert ("rank 1 was killed by SIGABRT while exiting, after every rank had finished its "
            "work") in result.out
    assert sorted(losses_of(metrics)) == [1, 2]
    assert CheckpointReader(save).iteration == 2
