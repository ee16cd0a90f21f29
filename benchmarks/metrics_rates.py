"""Runs side by side from their metrics files: tokens/s (the first quarter of the steps left
out: kernel selection, allocator warm-up), final loss, and each run's largest relative loss
difference and speed against the first one. Used by benchmarks/gpu_smoke.sh.

    python benchmarks/metrics_rates.py TOKENS_PER_ITER A.jsonl B.jsonl ...
"""

from __future__ import annotations

import json
import pathlib
import sys


def summary(path: str, tokens_per_iter: int) -> dict:
    records = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    if not steps:
        raise SystemExit(f"{path}: no training steps")
    timed = steps[len(steps) // 4:] or steps
    return {"rate": tokens_per_iter * len(timed) / sum(r["step_time_s"] for r in timed),
            "losses": [r["lm_loss"] for r in steps]}


def report(tokens_per_iter: int, paths: list[str]) -> list[str]:
    runs = [(pathlib.Path(p).stem, summary(p, tokens_per_iter)) for p in paths]
    base = runs[0][1]
    lines = []
    for name, run in runs:
        drift = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], base["losses"]))
        lines.append(f"{name:12s}: {run['rate']:10.0f} tokens/s ({run['rate'] / base['rate']:.2f}x "
                     f"{runs[0][0]}), final loss {run['losses'][-1]:.4f}, max relative loss "
                     f"difference to {runs[0][0]} {drift:.2e}")
    return lines


if __name__ == "__main__":
    print("\n".join(report(int(sys.argv[1]), sys.argv[2:])))
