"""A whole node lost, simulated on one machine: two `plugtron train` launchers (2 ranks each) as
two nodes at a c10d rendezvous on localhost; the second one's launcher and ranks are SIGKILLed
mid-run.

* Elastic (``--nnodes 1:2 --max-restarts 1``): the survivors re-form as a group of one node
  (dp 4 -> dp 2), resume from the latest complete checkpoint and finish with one process's
  losses (relative 1e-5: only the order of the sums changes with dp).
* Fixed (``--nnodes 2``, no restarts): the survivors stop with an error naming the failure,
  well within the distributed timeout; nothing hangs.
* The node whose launcher holds the c10d rendezvous lost: the others cannot re-form and stop
  with a message (no traceback).
"""

from __future__ import annotations

import socket
import time

import pytest

from .test_two_nodes import _close, _free_port
from .tools import finish, kill_group, losses_of, run_cli, start_cli, tiny_flags, wait_for

ITERS = 12
FLAGS = tiny_flags(train_iters=ITERS, log_interval=1, eval_interval=0,
                   distributed_timeout_minutes=1)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    path = tmp_path_factory.mktemp("alone") / "m.jsonl"
    done = run_cli(["train", *FLAGS, "--metrics-file", str(path)])
    assert done.rc == 0, done.out
    return losses_of(path)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _iterations(paths) -> int:
    best = 0
    for path in paths:
        try:
            best = max(best, len(losses_of(path)))
        except (OSError, ValueError):
            pass
    return best


def _start_two_nodes(tmp_path, nnodes: str, *extra: str):
    port = _free_port()
    procs, metrics = [], []
    for node in (0, 1):
        metrics.append(tmp_path / f"node{node}.jsonl")
        procs.append(start_cli(["train", *FLAGS, *extra, "--nnodes", nnodes, "--node-rank",
                                str(node), "--nproc-per-node", "2", "--rdzv-endpoint",
                                f"127.0.0.1:{port}", "--metrics-file", str(metrics[-1])]))
        if node == 0:  # the first launcher hosts the rendezvous, as node 0 does on a cluster
            assert wait_for(lambda: _listening(port), 60), "node 0 never opened the rendezvous"
    # Global rank 0 (which the rendezvous may place on either node) writes its node's file.
    assert wait_for(lambda: _iterations(metrics) >= 4, 90), "the two nodes never trained"
    return procs, metrics


def test_survivors_of_a_lost_node_reform_and_finish(tmp_path, alone):
    save = str(tmp_path / "ckpt")
    procs, metrics = _start_two_nodes(tmp_path, "1:2", "--max-restarts", "1", "--save", save,
                                      "--load", save, "--save-interval", "2")
    lost = time.monotonic()
    kill_group(procs[1].pid)  # the launcher and its ranks: a machine gone
    done = finish(procs[0])
    assert done.rc == 0 and not done.timed_out, done.out
    assert "saved with tp 1 pp 1 cp 1 dp 4" in done.out  # resumed after re-forming
    print(f"re-formed and finished {time.monotonic() - lost:.1f} s after the node was lost")
    # The survivors' rank 0 writes this node's file from its restart on.
    got = losses_of(metrics[0])
    assert max(got) == ITERS
    _close(got, {i: alone[i] for i in got}, "after losing a node")


def test_without_restarts_the_survivors_stop(tmp_path):
    procs, _ = _start_two_nodes(tmp_path, "2")
    lost = time.monotonic()
    kill_group(procs[1].pid)
    done = finish(procs[0])
    assert not done.timed_out and done.rc != 0, done.out
    stopped = time.monotonic() - lost
    print(f"the survivors stopped {stopped:.1f} s after the node was lost")
    assert stopped < 60  # well within --distributed-timeout-minutes 1
    assert "Traceback" not in done.out.split("\n")[-1]


def test_losing_the_rendezvous_node_ends_the_job_with_a_message(tmp_path):
    # torch's c10d rendezvous lives in the launcher at --rdzv-endpoint (the first one here)
    procs, _ = _start_two_nodes(tmp_path, "1:2", "--max-restarts", "1")
    lost = time.monotonic()
    kill_group(procs[0].pid)
    done = finish(procs[1])
    assert not done.timed_out and done.rc == 1, done.out
    assert "lost the rendezvous at 127.0.0.1:" in done.out and "Traceback" not in done.out
    print(f"the other node stopped {time.monotonic() - lost:.1f} s after the loss")


def test_bad_elastic_node_counts_exit_2():
    from click.testing import CliRunner
    from plugtron.cli.main import cli

    for args, message in (
            (["--nnodes", "2:1"], "need 1 <= MIN <= MAX"),
            (["--nnodes", "x"], "give a number of nodes N, or MIN:MAX"),
            (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "add --max-restarts K"),
            (["--nnodes", "1:2", "--max-restarts", "1", "--rdzv-endpoint", "h:1",
              "--nproc-per-node", "2", "--tp", "4"],
             "may re-form with 1 node(s) (2 ranks), where world size 2 is not divisible")):
        done = CliRunner().invoke(cli, ["train", *tiny_flags(train_iters=1), *args])
        assert done.exit_code == 2 and message in done.output, (args, done.output)
