"""Under SLURM without torchrun (``srun plugtron train ...``), every task takes its rank and the
world from SLURM's variables (core/parallel/distributed.py: slurm_world). Four tasks started with
a faked SLURM environment (tests/reliability/fake_srun.py) train dp 4 together with one
process's losses; the node-list parser on SLURM's compressed forms."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
from plugtron.core.parallel import distributed
from plugtron.core.parallel.distributed import expand_nodelist, slurm_world, tasks_on_node

from . import fake_srun
from .tools import HARD_TIMEOUT_S, kill_group, plugtron_argv, run_cli, tiny_flags

TOL = 1e-5


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("a,b", ["a", "b"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-[1-2]", ["gpu-1", "gpu-2"]),
    ("gpu-[8-10]", ["gpu-8", "gpu-9", "gpu-10"]),
    ("x[1-2],y,z[009-010]", ["x1", "x2", "y", "z009", "z010"]),
    ("r[1-2]-n[1,3]", ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),
    ("host.example.com,gpu[3]", ["host.example.com", "gpu3"]),
])
def test_nodelist_expansion(nodelist, hosts):
    assert list(expand_nodelist(nodelist)) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-04", "node01-04]", "a,,b", "node[a-b]", "n[]",
                                 "n[1-]"])
def test_malformed_nodelists_are_refused(bad):
    with pytest.raises(ValueError):
        list(expand_nodelist(bad))


def test_first_host_of_a_huge_range_is_found_lazily():
    assert next(expand_nodelist("n[0000001-9999999]")) == "n0000001"


def test_tasks_per_node_compressed_form():
    assert [tasks_on_node("2(x3),1", node) for node in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("8", 5) == 8


def _env(**extra):
    return {**fake_srun.slurm_env(5, 16, 12345, "node[07-08]"), "SLURM_NODEID": "1",
            "SLURM_LOCALID": "5", "SLURM_TASKS_PER_NODE": "8(x2)", **extra}


def test_slurm_world_from_srun_variables():
    assert slurm_world(_env()) == {
        "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "node07", "MASTER_PORT": str(distributed.SLURM_PORT_BASE + 2345)}
    given = slurm_world(_env(MASTER_PORT="29999", MASTER_ADDR="head", SLURM_NTASKS_PER_NODE="4"))
    assert given["MASTER_PORT"] == "29999" and given["MASTER_ADDR"] == "head"
    assert given["LOCAL_WORLD_SIZE"] == "4"


def test_torchrun_under_slurm_and_single_tasks_keep_their_world():
    assert slurm_world(_env(RANK="0", WORLD_SIZE="2")) is None  # torchrun inside the allocation
    assert slurm_world(_env(SLURM_NTASKS="1")) is None  # one task: plugtron's own launcher
    assert slurm_world(_env(PLUGTRON_SLURM="0")) is None
    assert slurm_world({"PATH": "/bin"}) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(path) -> dict[int, float]:
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r and "iteration" in r}


def test_four_srun_tasks_train_dp4_with_one_process_losses(tmp_path):
    flags = tiny_flags(train_iters=3, log_interval=1)
    one = run_cli(["train", *flags, "--metrics-file", str(tmp_path / "one.jsonl")])
    assert one.rc == 0, one.out
    metrics = tmp_path / "srun.jsonl"
    procs = fake_srun.start(
        plugtron_argv("train", *flags, "--metrics-file", str(metrics)), 4,
        env={"MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
             "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=HARD_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc.pid)
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(outs)
    assert "summary:" in outs[0] and "summary:" not in outs[1]  # rank 0 reports, the others not
    want, got = _losses(tmp_path / "one.jsonl"), _losses(metrics)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    assert all(abs(got[i] - want[i]) <= TOL * abs(want[i]) for i in want), (got, want)


def test_user_errors_under_srun_are_exit_2():
    flags = tiny_flags(train_iters=1)
    env = {**fake_srun.slurm_env(0, 4, 4242, "localhost")}
    both = run_cli(["train", *flags, "--nproc-per-node", "2"], env=env)
    assert both.rc == 2 and "cannot be used under torchrun or srun" in both.out, both.out
    bad = run_cli(["train", *flags], env={**env, "SLURM_NODELIST": "node[01-",
                                          "SLURM_JOB_NODELIST": "node[01-"})
    assert bad.rc == 2 and "cannot read the world from SLURM's variables" in bad.out, bad.out
    assert "Traceback" not in both.out + bad.out
