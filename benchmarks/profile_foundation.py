"""Per-op profile of plugtron's step against the plain loop's, by op and input shape.

Usage: python benchmarks/profile_foundation.py [--model issue|small] [--precision fp32|bf16]
       [--steps 4] [--rows 60]

bench_foundation's two sides on the same batches, each step under torch.profiler with
``record_shapes``, the sides alternating which goes first; prints self CPU milliseconds per step
of every (op, input shapes) pair for both sides, largest first, and the call counts. A
difference on the same op and shapes is the machine (noise), not the code; look for ops or
counts that only one side has.
"""

from __future__ import annotations

import argparse
import collections

import torch
from bench_foundation import MODELS, SIZES, plain_stepper
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.training.data import microbatch_iterator
from plugtron.core.training.loop import data_iterators, setup, train_step
from torch.profiler import ProfilerActivity, profile


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="issue")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = config_from_flags({**SIZES, **MODELS[args.model][0], "bf16": args.precision == "bf16",
                          "train-iters": args.warmup + args.steps}, "bench")
    run = setup(config, world=single_process())
    MetricsLogger(config, rank=1)
    ours_iter = data_iterators(run, run.datasets[0], 0)
    batches = microbatch_iterator(run.datasets[0], config.training.micro_batch_size, 0, 1)
    plain = plain_stepper(config, torch.bfloat16 if args.precision == "bf16" else torch.float32)
    total = {"plugtron": collections.Counter(), "plain": collections.Counter()}
    calls = {"plugtron": collections.Counter(), "plain": collections.Counter()}
    for iteration in range(1, args.warmup + args.steps + 1):
        batch = [next(batches) for _ in range(run.num_microbatches)]
        run.scheduler.prepare(iteration)
        for side in ("plugtron", "plain") if iteration % 2 else ("plain", "plugtron"):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                train_step(run, ours_iter) if side == "plugtron" else plain(batch)
            if iteration <= args.warmup:
                continue
            for event in prof.key_averages(group_by_input_shape=True):
                key = (event.key[:40], str(event.input_shapes)[:80])
                total[side][key] += event.self_cpu_time_total / 1e3 / args.steps
                calls[side][key] += event.count / args.steps
    keys = sorted(set(total["plugtron"]) | set(total["plain"]),
                  key=lambda k: -max(total["plugtron"][k], total["plain"][k]))
    print(f"{'op':40} {'input shapes':80} {'ours ms':>8} {'plain ms':>8} {'calls':>6} "
          f"{'calls':>6}")
    for key in keys[:args.rows]:
        print(f"{key[0]:40} {key[1]:80} {total['plugtron'][key]:8.1f} {total['plain'][key]:8.1f}"
              f" {calls['plugtron'][key]:6.0f} {calls['plain'][key]:6.0f}")
    for side in total:
        print(f"{side}: {sum(total[side].values()):.1f} ms self CPU per step")


if __name__ == "__main__":
    main()
