"""Exit under load: many short 2-rank runs back to back while other processes saturate the CPU.

A finished run must exit 0 every time. Before the deterministic exit (cli/rank.py) a rank
intermittently aborted after every rank had finished ("terminate called without an active
exception", killed by SIGABRT during 'done'), which failed fresh-clone CI runs.

    python benchmarks/exit_stress.py --runs 200 --load 2 [--write]

Each run: ``plugtron train --nproc-per-node 2`` on a 1-layer model, mock data, 2 iterations.
``--load N`` busy-loop processes run beside it for the whole time. Reports runs, failures (with
each failed run's last lines), and seconds per run; ``--write`` puts the figures in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RUN = ["train", "--data", "mock", "--train-iters", "2", "--nproc-per-node", "2",
       "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
       "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--eval-iters", "1", "--log-interval", "1"]


def _spin(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def plugtron_command() -> list[str]:
    here = os.path.dirname(sys.executable)
    exe = os.path.join(here, "plugtron")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "plugtron.cli.main"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2,
                        help="busy-loop processes beside the runs (default: one per core)")
    parser.add_argument("--max-minutes", type=float, default=60.0,
                        help="stop early (and say so) after this long")
    parser.add_argument("--write", action="store_true", help="write RESULTS.md's section")
    args = parser.parse_args()

    deadline = time.time() + args.max_minutes * 60
    spinners = [multiprocessing.Process(target=_spin, args=(deadline,), daemon=True)
                for _ in range(args.load)]
    for p in spinners:
        p.start()
    failures, done, start = [], 0, time.monotonic()
    try:
        for i in range(args.runs):
            if time.time() > deadline:
                break
            proc = subprocess.run([*plugtron_command(), *RUN], capture_output=True, text=True,
                                  cwd=os.environ.get("TMPDIR", "/tmp"))
            done += 1
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
                failures.append((i, proc.returncode, tail))
                print(f"run {i}: exit {proc.returncode}\n  " + "\n  ".join(tail), flush=True)
            elif (i + 1) % 10 == 0:
                print(f"{i + 1} runs, {len(failures)} failed", flush=True)
    finally:
        for p in spinners:
            p.terminate()
    seconds = time.monotonic() - start
    print(f"runs {done}, failed {len(failures)}, {seconds / max(done, 1):.1f} s per run, "
          f"load {args.load} busy processes on {os.cpu_count()} cores")
    if args.write:
        from results import write_section

        cut = "" if done == args.runs else f" (stopped after {done} of {args.runs}: time limit)"
        write_section(
            f"## Exit under load ({datetime.date.today()})\n\n"
            f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, gloo, "
            f"{args.load} busy-loop processes beside the runs for the whole time.\n\n"
            f"Command: `python benchmarks/exit_stress.py --runs {args.runs} --load {args.load} "
            f"--write`\n\n"
            f"| runs | failed | seconds per run |\n|---|---|---|\n"
            f"| {done}{cut} | {len(failures)} | {seconds / max(done, 1):.1f} |\n\n"
            "Each run is `plugtron train --nproc-per-node 2` on a 1-layer model, mock data, 2 "
            "iterations and a validation. A failure is any exit code but 0.\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
