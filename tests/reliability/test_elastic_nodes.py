"""A whole node lost, simulated on one machine: two `plugtron train` launchers (2 ranks each) as
two nodes at a c10d rendezvous on localhost; the second one's launcher and ranks are SIGKILLed
mid-run.

* Elastic (``--nnodes 1:2 --max-restarts 1``): the survivors re-form as a group of one node
  (dp 4 -> dp 2), resume from the latest complete checkpoint and finish with one process's
  losses (relative 1e-5: only the order of the sums changes with dp). ``--rdzv-conf
  last_call_timeout=5`` shortens torch's wait for more nodes (30 s) and shows the setting
  reaches the rendezvous.
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
LAST_CALL_S = 5
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
    """Node 0's launcher hosts the rendezvous, as on a cluster; node 1 (``is_host=0``: on one
    machine both would match the endpoint's host) starts first and waits for it, so the two
    join within the short last call. Node 1 starting first also puts global rank 0 on the node
    whose launcher does not hold the save lock (the rendezvous orders nodes as it likes)."""
    port = _free_port()
    procs, metrics = [], [tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"]
    for node in (1, 0):
        # a 1 s heartbeat: the lost node leaves the rendezvous after 3 s missed, not 15 s
        conf = (f"last_call_timeout={LAST_CALL_S},keep_alive_interval=1"
                + (",is_host=0" if node else ""))
        procs.append(start_cli(["train", *FLAGS, *extra, "--nnodes", nnodes, "--node-rank",
                                str(node), "--nproc-per-node", "2", "--rdzv-endpoint",
                                f"127.0.0.1:{port}", "--rdzv-conf", conf,
                                "--metrics-file", str(metrics[node])]))
    procs.reverse()
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
    took = time.monotonic() - lost
    print(f"re-formed and finished {took:.1f} s after the node was lost")
    assert took < 30, "torch's default last call (30 s) was waited: --rdzv-conf did not reach it"
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
             "may re-form with 1 node(s) (2 ranks), where world size 2 is not divisible"),
            (["--rdzv-conf", "last_call_timeout=3"], "give it with --nnodes or --max-restarts"),
            (["--max-restarts", "1", "--rdzv-conf", "last_call=3"],
             "unknown setting 'last_call'; allowed: join_timeout, last_call_timeout"),
            (["--max-restarts", "1", "--rdzv-conf", "join_timeout=soon"],
             "join_timeout needs a whole number of at least 1"),
            (["--max-restarts", "1", "--rdzv-conf", "is_host=maybe"],
             "is_host is true or false (1 or 0)")):
        done = CliRunner().invoke(cli, ["train", *tiny_flags(train_iters=1), *args])
        assert done.exit_code == 2 and message in done.output, (args, done.output)


def test_rdzv_conf_reaches_torchrun():
    from plugtron.cli.train import node_layout

    nodes = node_layout(False, "1:2", 0, None, 29500, "h:1", 1,
                        "last_call_timeout=3, join_timeout=60,is_host=false")
    assert nodes.torchrun_options()[-1] == \
        "--rdzv-conf=last_call_timeout=3,join_timeout=60,is_host=0"
    assert not any(o.startswith("--rdzv-conf") for o in
                   node_layout(False, "2", 0, None, 29500, "h:1", 0).torchrun_options())
