"""What ``srun --ntasks N`` does for plugtron, without SLURM: start N copies of a command on this
machine, each with the SLURM variables srun would give its task (no RANK/WORLD_SIZE, no
torchrun), and wait for all of them.

    python -m tests.reliability.fake_srun -n 4 -- python -m plugtron.cli.main train ...

Exit status: the first non-zero one of the tasks, else 0."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")


def slurm_env(task: int, ntasks: int, job_id: int, nodelist: str) -> dict[str, str]:
    """The variables of task ``task`` of a one-node step of ``ntasks`` tasks."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "SLURM_NODEID": "0",
            "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks), "SLURM_NNODES": "1",
            "SLURM_TASKS_PER_NODE": str(ntasks), "SLURM_NODELIST": nodelist,
            "SLURM_JOB_NODELIST": nodelist}


def start(command: list[str], ntasks: int, job_id: int = 4242, nodelist: str = "localhost",
          env: dict | None = None, **popen) -> list[subprocess.Popen]:
    base = {k: v for k, v in {**os.environ, **(env or {})}.items()
            if k not in TORCHRUN_VARIABLES}
    return [subprocess.Popen(command, env={**base, **slurm_env(task, ntasks, job_id, nodelist)},
                             **popen) for task in range(ntasks)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--ntasks", type=int, required=True)
    parser.add_argument("--job-id", type=int, default=4242)
    parser.add_argument("--nodelist", default="localhost")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    procs = start(command, args.ntasks, args.job_id, args.nodelist)
    codes = [proc.wait() for proc in procs]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
