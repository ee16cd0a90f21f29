"""Several nodes, simulated on one machine: two `plugtron train --nnodes 2 --node-rank R`
launchers (2 ranks each) meet at a c10d rendezvous on localhost, train tp 2 x dp 2 and pp 2 x
dp 2 with one process's losses (relative 1e-5), write one checkpoint (node 0 holds the save
lock; each piece is written once, by its data-parallel rank 0, whichever node holds it), and the
run resumes on one node of 4 ranks with the uninterrupted losses."""

from __future__ import annotations

import socket

import pytest

from .tools import finish, losses_of, run_cli, start_cli, tiny_flags

ITERS, STOP = 6, 3
FLAGS = tiny_flags(train_iters=ITERS, log_interval=1, num_layers=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, got, want)
    for i, value in want.items():
        assert abs(got[i] - value) <= 1e-5 * abs(value), (what, i, got[i], value)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    path = tmp_path_factory.mktemp("alone") / "m.jsonl"
    done = run_cli(["train", *FLAGS, "--metrics-file", str(path)])
    assert done.rc == 0, done.out
    return losses_of(path)


def _two_nodes(tmp_path, layout: list[str], *extra: str):
    port = _free_port()
    procs = []
    for node in (0, 1):
        args = ["train", *FLAGS, *layout, *extra, "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                str(port), "--metrics-file", str(tmp_path / f"node{node}.jsonl")]
        procs.append(start_cli(args))
    return [finish(p) for p in procs]


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]], ids=["tp2-dp2", "pp2-dp2"])
def test_two_nodes_train_like_one_process(tmp_path, alone, layout):
    resume = layout == ["--tp", "2"]  # the resume on one node, once (each run costs seconds)
    save = str(tmp_path / "ckpt")
    extra = ["--save", save, "--exit-interval", str(STOP)] if resume else []
    nodes = _two_nodes(tmp_path, layout, *extra)
    for node, done in enumerate(nodes):
        assert done.rc == 0 and not done.timed_out, (node, done.out)
    want = {i: alone[i] for i in range(1, (STOP if resume else ITERS) + 1)}
    _close(losses_of(tmp_path / "node0.jsonl"), want, "two nodes")
    assert not (tmp_path / "node1.jsonl").exists()  # global rank 0 writes the metrics
    if not resume:
        return
    again = run_cli(["train", *FLAGS, "--nproc-per-node", "4", "--load", save, "--save", save,
                     "--metrics-file", str(tmp_path / "resumed.jsonl")])
    assert again.rc == 0, again.out
    _close(losses_of(tmp_path / "resumed.jsonl"), {i: alone[i] for i in range(STOP + 1, ITERS + 1)},
           "resumed on one node of 4 ranks")


def test_bad_node_options_exit_2():
    from click.testing import CliRunner
    from plugtron.cli.main import cli

    for args, message in (
            (["--nnodes", "2"], "say where the nodes meet"),
            (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "must be below"),
            (["--nnodes", "2", "--rdzv-endpoint", "nohostport"], "must be HOST:PORT"),
            (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--master-addr", "h"], "not both")):
        done = CliRunner().invoke(cli, ["train", *tiny_flags(train_iters=1), *args])
        assert done.exit_code == 2 and message in done.output, (args, done.output)
