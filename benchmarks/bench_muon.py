"""Muon against Adam side by side, in one run: the step time and the optimizer's share of it
(one process and dp 2, rounds alternating between the optimizers so both see the same machine
load), and the optimizer state per rank at dp 1 and dp 4 read off the tensors, with
``plugtron estimate``'s figure for it.

    .venv/bin/python benchmarks/bench_muon.py            # writes its section of RESULTS.md
    .venv/bin/python benchmarks/bench_muon.py --no-write --rounds 1

Every rank is a gloo process with one intra-op thread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from probes import StepTimes
from results import write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL = {"lr": 1e-3, "min-lr": 1e-4, "lr-warmup-iters": 1, "eval-interval": 0,
         "hidden-dropout": 0.0, "attention-dropout": 0.0, "data": "mock", "progress": False,
         "log-interval": 0, "num-layers": 4, "hidden-size": 256, "num-attention-heads": 8,
         "seq-length": 128, "micro-batch-size": 4, "global-batch-size": 8, "swiglu": True,
         "vocab-size": 512, "make-vocab-size-divisible-by": 128}
OPTIMIZERS = {
    "adam": {"optimizer": "adam"},
    "muon (bf16 iteration)": {"optimizer": "muon"},
    "muon (fp32 iteration)": {"optimizer": "muon", "muon-fp32-matmul-prec": "high"},
}
SHARDED = {"distributed-adam": {"optimizer": "adam", "use-distributed-optimizer": True},
           "muon, layer-wise": {"optimizer": "muon", "use-distributed-optimizer": True}}
WARMUP = 2


def _train(rank, world_size, flags: dict, iters: int) -> dict:
    """In each pool rank: a short run; its step times, optimizer step times and state bytes."""
    import torch
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.training.loop import setup, train

    torch.set_num_threads(1)
    config = config_from_flags({**flags, "train-iters": iters}, "benchmark")
    recorder = StepTimes()
    run = setup(config, extra_plugins=[recorder])
    step, optimizer_times = run.optimizer.step, []

    def timed_step():
        start = time.perf_counter()
        result = step()
        optimizer_times.append(time.perf_counter() - start)
        return result

    run.optimizer.step = timed_step
    train(run, MetricsLogger(config, rank=1))
    return {"step_s": statistics.median(recorder.times[WARMUP:]),
            "optimizer_s": statistics.median(optimizer_times[WARMUP:]),
            "state_bytes": run.optimizer.state_bytes(),
            "parameters": sum(p.numel() for chunk in run.model_chunks for p in chunk.parameters())}


def _estimate(flags: dict, world: int) -> int:
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.tools.estimate import estimate_memory

    return estimate_memory(config_from_flags(flags, "benchmark"), world,
                           cuda=False).peak.optimizer_selected


def measure(rounds: int, iters: int) -> dict:
    from plugtron.testing import DistributedPool

    speed: dict = {}
    memory: dict = {}
    load_before = os.getloadavg()[0]
    with DistributedPool(4, timeout=1800) as pool:
        for _ in range(rounds):
            for dp, table in ((1, OPTIMIZERS), (2, {**OPTIMIZERS, **SHARDED})):
                for name, flags in table.items():
                    ranks = pool.run(_train, {**MODEL, **flags}, iters, world_size=dp)
                    speed.setdefault((dp, name), []).append(
                        (max(r["step_s"] for r in ranks), max(r["optimizer_s"] for r in ranks)))
        for dp, table in ((1, OPTIMIZERS), (4, {**OPTIMIZERS, **SHARDED})):
            for name, flags in table.items():
                if "fp32" in name:
                    continue  # the same state as the bf16 iteration
                ranks = pool.run(_train, {**MODEL, **flags, "global-batch-size": 16}, 3,
                                 world_size=dp)
                memory[(dp, name)] = (max(r["state_bytes"] for r in ranks),
                                      _estimate({**MODEL, **flags}, dp))
                parameters = ranks[0]["parameters"]
    return {"speed": speed, "memory": memory, "parameters": parameters,
            "load_before": load_before,
            "load_after": os.getloadavg()[0]}


TEMPLATE = """## Muon against Adam: step time and optimizer state ({date})

Machine: 2-core CPU, gloo, one intra-op thread per rank; 1-minute load average
{load_before:.1f} at the start, {load_after:.1f} at the end (the CPU is shared with other
engineers' runs: the times are noisy). Command: `{command}`

Model: 4 layers, hidden 256, 8 heads, SwiGLU, vocab 512, seq 128, micro batch 4, global batch 8,
fp32 ({params:.2f}M parameters). Median of iterations {first}-{iters} per run, slower rank,
{rounds} rounds alternating between the optimizers; "optimizer" is `optimizer.step()` alone
(norm, clipping, the update, sharing the parameters).

| dp | optimizer | step time per round (s) | median step (s) | x adam | optimizer step (s) |
|---|---|---|---|---|---|
{speed}

**Optimizer state per rank** (fp32 values the optimizer keeps, bytes read off its tensors after
3 iterations; global batch 16) and `plugtron estimate`'s optimizer figure for the rank:

| dp | optimizer | state (MiB) | x dp 1 adam | estimate (MiB) |
|---|---|---|---|---|
{memory}

Muon keeps one momentum per matrix element (AdamW two moments for the embeddings, norms and
biases), so its state is about half of Adam's; the layer-wise mode splits it over dp by whole
matrices (the largest rank's share is shown: whole parameters do not split evenly). Its step
costs the Newton-Schulz iterations (five steps of three matrix products per matrix): the bf16
iteration (the default) is the faster one on this CPU, which has bf16 matrix units (AMX); in the
layer-wise mode each rank runs the iterations of its own matrices only.
"""


def report(result: dict, rounds: int, iters: int) -> str:
    speed_rows = []
    for (dp, name), runs in result["speed"].items():
        adam = statistics.median(s for s, _ in result["speed"][(dp, "adam")])
        median = statistics.median(s for s, _ in runs)
        speed_rows.append(f"| {dp} | {name} | {', '.join(f'{s:.3f}' for s, _ in runs)} | "
                          f"{median:.3f} | {median / adam:.2f} | "
                          f"{statistics.median(o for _, o in runs):.3f} |")
    base = result["memory"][(1, "adam")][0]
    memory_rows = [f"| {dp} | {name} | {state / 2**20:.2f} | {state / base:.2f} | "
                   f"{estimate / 2**20:.2f} |"
                   for (dp, name), (state, estimate) in result["memory"].items()]
    return TEMPLATE.format(date=datetime.date.today().isoformat(), command=" ".join(
        ["python", "benchmarks/bench_muon.py", *sys.argv[1:]]), rounds=rounds, iters=iters,
        first=WARMUP + 1, params=result["parameters"] / 1e6, speed="\n".join(speed_rows),
        memory="\n".join(memory_rows), load_before=result["load_before"],
        load_after=result["load_after"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    text = report(measure(args.rounds, args.iters), args.rounds, args.iters)
    text = text.replace("`\n\nModel:", f"` (took {time.perf_counter() - start:.0f} s)\n\nModel:",
                        1)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
