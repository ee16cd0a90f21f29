"""Two "nodes" and an elastic restart on one machine, on whatever backend it has (NCCL with two
GPUs, gloo on CPU): the same code path the suite's reliability tests take on gloo, for
benchmarks/gpu_smoke.sh to exercise on GPUs.

1. One process trains the reference (dp 1).
2. Two `plugtron train --nnodes 2 --node-rank R --nproc-per-node 1` launchers meet at a c10d
   rendezvous on localhost and train dp 2 (each launcher sees one GPU through
   CUDA_VISIBLE_DEVICES, as on two real nodes).
3. `plugtron train --nproc-per-node 2 --max-restarts 1 --save D --load D`: rank 1 is SIGKILLed
   after a few iterations; the group restarts and resumes from the latest checkpoint.

Prints each run's losses against the reference (relative difference; GPU kernels need not be
bitwise deterministic, so this reports rather than asserts) and the restart's wall time.
Exit 1 when a run fails or the restart did not resume.
Usage: python benchmarks/nodes_smoke.py [ITERS]
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
MODEL = ["--data", "mock", "--vocab-size", "1024", "--num-layers", "4", "--hidden-size", "256",
         "--num-attention-heads", "8", "--seq-length", "256", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-3",
         "--eval-interval", "0", "--log-interval", "1", "--no-progress",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
PLUGTRON = [sys.executable, "-m", "plugtron.cli.main", "train"]


def losses(metrics: Path) -> dict[int, float]:
    out = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "lm_loss" in record and "iteration" in record:
            out[record["iteration"]] = record["lm_loss"]
    return out


def drift(got: dict[int, float], want: dict[int, float]) -> float:
    missing = sorted(set(want) - set(got))
    if missing:
        raise SystemExit(f"iterations {missing} have no loss")
    return max(abs(got[i] - want[i]) / abs(want[i]) for i in want)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(args: list[str], env: dict | None = None) -> None:
    done = subprocess.run(PLUGTRON + MODEL + args, env=env)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {' '.join(args)}")


def rank_pids(launcher: int) -> dict[int, int]:
    """{RANK: pid} of the launcher's descendants that run plugtron's rank entry point."""
    out = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"plugtron.cli.rank" in cmdline and b"RANK" in env and int(name) != launcher:
            if _descends(int(name), launcher):
                out[int(env[b"RANK"])] = int(name)
    return out


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


def two_nodes(work: Path, want: dict[int, float]) -> None:
    port, procs = free_port(), []
    for node in (0, 1):
        env = dict(os.environ)
        if gpus() >= 2:
            env["CUDA_VISIBLE_DEVICES"] = str(node)
        procs.append(subprocess.Popen(
            PLUGTRON + MODEL + ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                                "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                "--metrics-file", str(work / f"node{node}.jsonl")], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"two nodes: exit codes {codes}")
    print(f"two nodes (dp 2): max relative loss difference to one process "
          f"{drift(losses(work / 'node0.jsonl'), want):.2e}")


def elastic_restart(work: Path, want: dict[int, float]) -> None:
    save, metrics = work / "elastic", work / "elastic.jsonl"
    args = ["--nproc-per-node", "2", "--max-restarts", "1", "--save", str(save), "--load",
            str(save), "--save-interval", "2", "--metrics-file", str(metrics)]
    proc = subprocess.Popen(PLUGTRON + MODEL + args, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(losses(metrics)) >= ITERS // 2:
            break
        time.sleep(0.2)
    victim = rank_pids(proc.pid).get(1)
    if victim is None or proc.poll() is not None:
        raise SystemExit("elastic: training did not start, or ended before the kill")
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    print(out[-3000:])
    if proc.returncode != 0 or "loaded checkpoint" not in out:
        raise SystemExit(f"elastic: exit {proc.returncode}, resumed: {'loaded checkpoint' in out}")
    print(f"elastic restart (rank 1 killed after {ITERS // 2} iterations): resumed and finished "
          f"in {time.monotonic() - killed:.1f} s, max relative loss difference to one process "
          f"{drift(losses(metrics), want):.2e}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run(["--metrics-file", str(work / "alone.jsonl")])
        want = losses(work / "alone.jsonl")
        two_nodes(work, want)
        elastic_restart(work, want)


if __name__ == "__main__":
    main()
