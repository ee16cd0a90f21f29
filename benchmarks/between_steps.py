"""Time a `plugtron train` run spends between its steps: the loop's own work (metrics, logging,
checks, the scheduler, the data position) that no step pays for in a plain training loop.

Runs the issue's Llama-shaped GPT (RMSNorm, rope, SwiGLU, GQA, no bias, untied; 4 layers, hidden
256, seq 256, micro batch 8) for ITERS iterations on mock data and on the text corpus (its
tokenizer and reads in the loop), and reports, from the metrics file, the wall time from the first
step's start to the last step's end against the sum of the steps' own times.

Usage: python benchmarks/between_steps.py [--iters 30] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from results import write_section

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--seq-length", "256", "--micro-batch-size", "8",
         "--global-batch-size", "8", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "rope", "--eval-interval", "0", "--no-progress",
         "--log-interval", "1"]
DATA = {"mock": ["--data", "mock", "--vocab-size", "4096"], "text": ["--data", "text"]}


def between(data: list[str], iters: int) -> tuple[float, float]:
    """(seconds between steps, seconds in steps) over iterations 2..iters (the first step's
    warm-up and the set-up before it left out): wall time from iteration 1's end to the last's,
    from the cumulative tokens/s each record carries, against the steps' own times."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        subprocess.run([sys.executable, "-m", "plugtron.cli.main", "train", *MODEL, *data,
                        "--train-iters", str(iters), "--metrics-file", metrics],
                       check=True, capture_output=True, env={**os.environ,
                                                             "OMP_NUM_THREADS": "1"})
        with open(metrics) as f:
            steps = [r for r in map(json.loads, f) if "step_time_s" in r]
    tokens = 8 * 256
    # tokens_per_sec is the whole job's since training started: elapsed = tokens seen / rate
    elapsed = [(i + 1) * tokens / r["tokens_per_sec"] for i, r in enumerate(steps)]
    wall = elapsed[-1] - elapsed[0]
    inside = sum(r["step_time_s"] for r in steps[1:])
    return wall - inside, inside


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    for name, data in DATA.items():
        gap, inside = between(data, args.iters)
        rows.append(f"| {name} | {inside / (args.iters - 1) * 1e3:.0f} | "
                    f"{gap / (args.iters - 1) * 1e3:.2f} | {gap / inside:.2%} |")
    text = "\n".join([
        f"\n## Time between steps ({time.strftime('%Y-%m-%d')})\n",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, one "
        f"thread. Command: `python benchmarks/between_steps.py --iters {args.iters}`. The "
        f"Llama-shaped GPT of the peer comparison (4 x 256, seq 256, micro batch 8, fp32), "
        f"iterations 2-{args.iters}: wall time from the end of iteration 1 to the end of the "
        f"last, against the sum of the steps' own times (goal: under 1%).\n",
        "| data | ms per step | ms between steps | between / steps |", "|---|---|---|---|",
        *rows])
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
