"""Does torch.compile of each decoder layer speed up plugtron's step on this machine?

Usage: python benchmarks/bench_compile.py [--model issue|small] [--precision fp32|bf16]
       [--rounds 5] [--threads 2]

Two runs of the same model, seed and data (bench_foundation's sizes): one eager, one with every
decoder layer compiled in place (``nn.Module.compile``, inductor, so parameter names, the
optimizer and the gradient buffers are untouched). It reports the seconds the compiled run's
first steps took (compilation), then the two runs' steps alternating, their median times and
ratio, and the largest difference of their losses. This decides whether a ``--compile`` flag is
worth adding; it is not one.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_foundation import MODELS, SIZES, median
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.training.loop import data_iterators, setup, train_step


def build(args, rounds):
    config = config_from_flags({**SIZES, **MODELS[args.model][0], "bf16": args.precision == "bf16",
                          "train-iters": rounds + args.warmup + 2}, "bench")
    run = setup(config, world=single_process())
    MetricsLogger(config, rank=1)
    return run, data_iterators(run, run.datasets[0], 0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="issue")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (the "
                        "compiled run compiles in its first one or two)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    eager, eager_iter = build(args, args.rounds)
    compiled, compiled_iter = build(args, args.rounds)
    for chunk in compiled.model_chunks:
        for layer in chunk.module.decoder.layers.values():
            layer.compile()
    times = {"eager": [], "compiled": []}
    losses = {"eager": [], "compiled": []}
    first = []
    for iteration in range(1, args.warmup + args.rounds + 1):
        order = ("eager", "compiled") if iteration % 2 else ("compiled", "eager")
        for name in order:
            run, it = (eager, eager_iter) if name == "eager" else (compiled, compiled_iter)
            run.scheduler.prepare(iteration)
            start = time.perf_counter()
            loss, _ = train_step(run, it)
            elapsed = time.perf_counter() - start
            losses[name].append(loss["lm loss"])
            if iteration > args.warmup:
                times[name].append(elapsed)
            elif name == "compiled":
                first.append(elapsed)
    ratios = [e / c for e, c in zip(times["eager"], times["compiled"])]
    diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
    print(f"model {args.model}, {args.precision}, {args.threads} threads, torch "
          f"{torch.__version__}")
    print(f"compiled run's warm-up steps (compilation included): "
          f"{', '.join(f'{t:.1f}' for t in first)} s")
    print(f"median step: eager {median(times['eager']):.3f} s, compiled "
          f"{median(times['compiled']):.3f} s over {args.rounds} alternating rounds; "
          f"median per-round speed-up {median(ratios):.3f} (range {min(ratios):.3f}-"
          f"{max(ratios):.3f}); largest loss difference {diff:.2e}")
    print(" ".join(["python benchmarks/bench_compile.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
