"""Checkpoint save and load times, sync against --async-save, size against raw tensor bytes.

Two models in one process, each built without training (model plus Adam state from one step on
zero gradients): the default model (``TrainConfig`` defaults on mock data) and a ~100M-parameter
GPT. For each: synchronous save (the loop is blocked for all of it), async save (the loop is
blocked only for the copy to host memory; the write is then waited for, as the next save or the
end of training would), and load (including checksum verification). Appends a section to
benchmarks/RESULTS.md.

    python benchmarks/bench_checkpoint.py [--repeats 3] [--no-results]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
from plugtron.core.checkpoint import Checkpointer, load_checkpoint
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.training.loop import setup
from results import write_section

MODELS = {
    "default": {},
    "~100M": {"num-layers": 10, "hidden-size": 768, "num-attention-heads": 12,
              "vocab-size": 32000, "seq-length": 128},
}
COMMON = {"data": "mock", "micro-batch-size": 1, "global-batch-size": 1, "train-iters": 1,
          "eval-interval": 0, "progress": False, "log-interval": 0}


def build(settings: dict, save: str):
    config = config_from_flags({**COMMON, **settings, "save": save}, "benchmark")
    run = setup(config, world=single_process())
    run.optimizer.zero_grad()
    run.scheduler.prepare(1)
    run.optimizer.step()  # Adam state exists (zero gradients: no forward/backward needed)
    run.state.iteration = 1
    return run


def raw_bytes(run) -> tuple[int, int]:
    """(parameters, bytes of model + optimizer tensors) as held in memory."""
    params = sum(p.numel() for c in run.model_chunks for p in c.module.parameters())
    model = sum(t.numel() * t.element_size() for c in run.model_chunks
                for t in c.module.state_dict().values())
    state = run.optimizer.sharded_state_dict()
    state.pop("__optimizer__", None)
    optim = sum(t.numel() * t.element_size() for s in state.values() for t in s.values())
    return params, model + optim


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)


def measure(name: str, settings: dict, repeats: int) -> dict:
    parent = tempfile.mkdtemp(prefix="plugtron-bench-ckpt-")
    try:
        run = build(settings, parent)
        params, raw = raw_bytes(run)
        ckpt = Checkpointer(run)
        times = {"sync": [], "async_blocked": [], "async_total": [], "load": []}
        size, iteration = 0, 0

        def path(i):
            return os.path.join(parent, f"iter_{i:07d}")

        for _ in range(repeats):
            iteration += 1
            start = time.perf_counter()
            ckpt.save(iteration, async_save=False)
            times["sync"].append(time.perf_counter() - start)
            size = dir_bytes(path(iteration))
            shutil.rmtree(path(iteration))
        for _ in range(repeats + 1):  # the first async save allocates the host buffers
            iteration += 1
            start = time.perf_counter()
            ckpt.save(iteration, async_save=True)
            times["async_blocked"].append(time.perf_counter() - start)
            ckpt.wait()
            times["async_total"].append(time.perf_counter() - start)
            if _ < repeats:
                shutil.rmtree(path(iteration))
        for _ in range(repeats):
            start = time.perf_counter()
            load_checkpoint(run, path(iteration))
            times["load"].append(time.perf_counter() - start)
        med = statistics.median
        return {"model": name, "params": params, "raw": raw, "size": size,
                "sync": med(times["sync"]), "async_first": times["async_blocked"][0],
                "async_blocked": med(times["async_blocked"][1:]),
                "async_total": med(times["async_total"][1:]), "load": med(times["load"]),
                "runs": times}
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def table(results: list[dict]) -> str:
    header = ("| model | params | raw tensor MiB | checkpoint MiB | size / raw | sync save s "
              "(loop blocked) | async: loop blocked s | async: until written s | blocked "
              "sync / async | first async save: blocked s | load s |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['raw'] / 2**20:.1f} | "
            f"{r['size'] / 2**20:.1f} | {r['size'] / r['raw']:.3f} | {r['sync']:.3f} | "
            f"{r['async_blocked']:.3f} | {r['async_total']:.3f} | "
            f"{r['sync'] / max(r['async_blocked'], 1e-9):.1f}x | {r['async_first']:.3f} | "
            f"{r['load']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    results = [measure(name, settings, args.repeats) for name, settings in MODELS.items()]
    took = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    runs = "\n".join(f"- {r['model']}: " + "; ".join(
        f"{k} " + ", ".join(f"{v:.3f}" for v in vals) for k, vals in r["runs"].items())
        for r in results)
    section = f"""
## Checkpoints ({time.strftime('%Y-%m-%d')})

Machine: 2-core CPU, gloo (one process; {platform.machine()}, torch {torch.__version__},
checkpoints on the local disk under {tempfile.gettempdir()}). The CPU is shared with other
engineers' test runs while this ran (load average {load_before:.1f} at the start,
{load_after:.1f} at the end), so the times are noisy: medians of {args.repeats} repeats.

Command: `python benchmarks/bench_checkpoint.py` (took {took:.0f} s)

Each model is built without training: parameters plus Adam state after one step on zero
gradients, fp32. "raw" is the bytes of the model's state_dict plus the optimizer's tensors in
memory; the checkpoint also holds JSON (config, RNG states, manifests). Saving fsyncs every
file and records its CRC-32; loading verifies every file before reading it. "default" is
`TrainConfig`'s defaults (4 layers, hidden 128, seq 128) on mock data (vocabulary 512); "~100M"
is 10 layers, hidden 768, 12 heads, vocabulary 32000.

{table(results)}

Per repeat (s):
{runs}

Async save blocks the training loop only while tensors are copied to host memory; the write
(serialisation, fsync, CRC-32) runs in a background thread, and the next save or the end of
training waits for it. The first async save also allocates the host buffers that later saves
reuse (one copy of the rank's checkpoint tensors stays allocated); allocating and
page-faulting fresh memory is most of its cost on this VM. Async medians leave the first save
out. On this machine the background write competes with training for the same two cores.
"""
    print(section)
    if not args.no_results:
        write_section(section)


if __name__ == "__main__":
    sys.exit(main())
