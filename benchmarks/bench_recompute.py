"""Activation recompute: peak activation memory held for backward and step time, per mode.

Usage: python benchmarks/bench_recompute.py [--rounds 5] [--write]

One process trains the GPT model (8 layers, hidden 256, 4 heads, seq 512, micro batch 4, fp32,
dropout 0) with each recompute mode. Peak memory is the largest number of bytes autograd keeps
alive for backward at once during a step (a saved-tensor hook counts every tensor the first
forward packs for backward until it is freed; a group's temporaries while it is recomputed are
saved by torch's checkpoint outside user hooks and not counted); it is exact and
machine-independent, where RSS on a CPU is not. Step time: the modes alternate step by step over the rounds; medians.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
import weakref

import torch
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.training.loop import data_iterators, setup, train_step
from results import write_section

BASE = {"num-layers": 8, "hidden-size": 256, "num-attention-heads": 4, "seq-length": 512,
        "max-position-embeddings": 512, "micro-batch-size": 4, "global-batch-size": 4,
        "vocab-size": 256, "data": "mock", "hidden-dropout": 0.0, "attention-dropout": 0.0,
        "progress": False, "eval-interval": 0, "log-interval": 0}
MODES = {
    "none": {},
    "selective core_attn": {"recompute-granularity": "selective"},
    "selective core_attn,mlp": {"recompute-granularity": "selective",
                                "recompute-modules": ["core_attn,mlp"]},
    "full uniform 1": {"recompute-granularity": "full"},
    "full uniform 4": {"recompute-granularity": "full", "recompute-num-layers": 4},
    "full block 4": {"recompute-granularity": "full", "recompute-method": "block",
                     "recompute-num-layers": 4},
}


class SavedBytes:
    def __init__(self):
        self.live = self.peak = 0

    def pack(self, tensor):
        size = tensor.untyped_storage().nbytes() if tensor.layout == torch.strided else 0
        self.live += size
        self.peak = max(self.peak, self.live)
        holder = _Held(tensor)
        weakref.finalize(holder, self._free, size)
        return holder

    def _free(self, size):
        self.live -= size


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def build(mode):
    run = setup(config_from_flags({**BASE, **MODES[mode]}, "bench"), world=single_process())
    return run, data_iterators(run, run.datasets[0], 0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    runs = {mode: build(mode) for mode in MODES}
    peaks, times = {}, {mode: [] for mode in MODES}
    for mode, (run, iterators) in runs.items():  # warm-up step, with the memory count
        counter = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda h: h.tensor):
            train_step(run, iterators)
        peaks[mode] = counter.peak
    for _ in range(args.rounds):
        for mode, (run, iterators) in runs.items():
            start = time.perf_counter()
            train_step(run, iterators)
            times[mode].append(time.perf_counter() - start)
    none_peak, none_time = peaks["none"], statistics.median(times["none"])
    lines = ["| mode | peak activation MiB | vs none | step s (median) | vs none |",
             "|---|---|---|---|---|"]
    for mode in MODES:
        t = statistics.median(times[mode])
        lines.append(f"| {mode} | {peaks[mode] / 2**20:.1f} | {peaks[mode] / none_peak:.2f} "
                     f"| {t:.3f} | {t / none_time:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_section(f"\n## Activation recompute ({datetime.date.today()})\n\n"
                      f"Machine: {platform.processor() or platform.machine()}, 2 threads; "
                      f"command: `python benchmarks/bench_recompute.py --rounds "
                      f"{args.rounds} --write`. GPT 8 layers, hidden 256, seq 512, micro "
                      f"batch 4, fp32. Peak activation = bytes autograd holds for backward at "
                      f"once (exact); step time median of {args.rounds} alternating rounds "
                      f"(the machine was shared with other work, so times are noisy).\n\n"
                      f"{table}\n")


if __name__ == "__main__":
    main()
