"""fsdp2 against ddp side by side, in one run: step time at dp 2 on the same model (rounds
alternate between the two, so both see the same machine load), and per-rank memory of a model
that dominates memory at dp 4: bytes of parameters + gradients + optimizer state read off the
tensors, the peak resident set of the step, and ``plugtron estimate``'s figure for it.

    .venv/bin/python benchmarks/bench_fsdp2.py            # writes its section of RESULTS.md
    .venv/bin/python benchmarks/bench_fsdp2.py --no-write --rounds 2

Every rank is a gloo process with one intra-op thread. Memory runs each start a fresh pool, so
a rank's resident-set high-water mark (``ru_maxrss``) belongs to that run alone; the figure is
the high-water mark over the resident set just before ``setup`` (the runtime, torch and
plugtron's imports left out, as the estimate leaves them out).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

from results import write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BASE = {"lr": 1e-3, "min-lr": 1e-4, "lr-warmup-iters": 1, "eval-interval": 0,
        "hidden-dropout": 0.0, "attention-dropout": 0.0, "data": "mock", "progress": False,
        "log-interval": 0}
SPEED_MODEL = {**BASE, "num-layers": 4, "hidden-size": 256, "num-attention-heads": 8,
               "seq-length": 128, "micro-batch-size": 4, "global-batch-size": 16,
               "vocab-size": 512, "make-vocab-size-divisible-by": 128}
MEMORY_MODEL = {**BASE, "num-layers": 8, "hidden-size": 1024, "num-attention-heads": 16,
                "seq-length": 64, "micro-batch-size": 1, "global-batch-size": 4,
                "vocab-size": 1024, "make-vocab-size-divisible-by": 128}
WRAPPERS = {"ddp": {"data-parallel": "ddp"},
            "ddp + distributed optimizer": {"data-parallel": "ddp",
                                            "use-distributed-optimizer": True},
            "fsdp2": {"use-torch-fsdp2": True}}
WARMUP = 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train(rank, world_size, flags: dict, iters: int) -> dict:
    """In each pool rank: a short run; its step times, state bytes and resident-set peak."""
    import resource

    import torch
    from plugtron.api import hookimpl, local_tensor
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.training.loop import setup, train

    class Recorder:
        def __init__(self):
            self.times = []

        @hookimpl
        def plugtron_step_end(self, iteration, metrics):
            self.times.append(metrics["step_time_s"])

    torch.set_num_threads(1)
    config = config_from_flags({**flags, "train-iters": iters}, "benchmark")
    recorder = Recorder()
    before = _rss_bytes()
    run = setup(config, extra_plugins=[recorder])
    grads = []
    step = run.optimizer.step

    def measured_step():
        total = 0
        for chunk in run.model_chunks:
            buffers = getattr(chunk, "grad_buffers", None)
            if buffers is not None:
                total += sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
            else:
                total += sum(local_tensor(p.grad).numel() * p.grad.element_size()
                             for p in chunk.parameters() if p.grad is not None)
        grads.append(total)
        return step()

    run.optimizer.step = measured_step
    train(run, MetricsLogger(config, rank=1))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(local_tensor(p).numel() * p.element_size()
                 for chunk in run.model_chunks for p in chunk.parameters())
    timed = recorder.times[WARMUP:] or recorder.times
    return {"step_s": statistics.median(timed), "times": recorder.times,
            "state_bytes": params + grads[-1] + run.optimizer.state_bytes(),
            "peak_over_start": peak - before}


def _estimate(flags: dict, world: int) -> int:
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.tools.estimate import estimate_memory

    return estimate_memory(config_from_flags(flags, "benchmark"), world, cuda=False).peak.total


def measure(rounds: int, iters: int) -> dict:
    from plugtron.testing import DistributedPool

    out: dict = {"load_before": os.getloadavg()[0], "speed": {"ddp": [], "fsdp2": []}}
    with DistributedPool(2, timeout=1800) as pool:
        for _ in range(rounds):
            for name in ("ddp", "fsdp2"):
                ranks = pool.run(_train, {**SPEED_MODEL, **WRAPPERS[name]}, iters)
                out["speed"][name].append(max(r["step_s"] for r in ranks))
    memory = {}
    for name, flags in WRAPPERS.items():
        for dp in (1, 4):
            if dp == 1 and name != "ddp":
                continue
            with DistributedPool(dp, timeout=1800) as pool:
                ranks = pool.run(_train, {**MEMORY_MODEL, **flags}, 2)
            memory[(name, dp)] = {
                "state": max(r["state_bytes"] for r in ranks),
                "peak": max(r["peak_over_start"] for r in ranks),
                "estimate": _estimate({**MEMORY_MODEL, **flags}, dp)}
    out["memory"] = memory
    out["load_after"] = os.getloadavg()[0]
    return out


TEMPLATE = """## fsdp2 against ddp: speed and memory per rank ({date})

Machine: 2-core CPU (AVX-512, AMX), gloo, one intra-op thread per rank; 1-minute load average
{load_before:.1f} at the start, {load_after:.1f} at the end. Command: `{command}`

**Speed**, dp 2, the same model (4 layers, hidden 256, seq 128, vocab 512, global batch 16,
micro batch 4, fp32): median step time of iterations {first}-{iters}, slower rank, {rounds}
alternating rounds per wrapper.

| wrapper | step time per round (s) | median (s) |
|---|---|---|
{speed}

fsdp2 / ddp step time: **{speed_ratio:.2f}x** (target <= 1.15x). fsdp2 gathers each layer
before its forward and again before its backward and reduce-scatters every microbatch's
gradients (4 per step here), where ddp all-reduces once per step.

**Memory per rank**, a model that dominates memory: 8 layers, hidden 1024, vocab 1024
({params:.1f}M parameters), seq 64, micro batch 1, global batch 4, fp32, Adam, two iterations.
"state" is parameters + gradients + optimizer state read off the tensors (their local
shards) at the optimizer step; "peak" the resident-set high-water mark over the resident set
before setup; "estimate" `plugtron estimate`'s total for the rank.

| wrapper | dp | state MiB | x dp 1 | peak RSS MiB | estimate MiB | estimate / peak |
|---|---|---|---|---|---|---|
{memory}
"""


def report(results: dict, rounds: int, iters: int, command: str) -> str:
    mib = 1 / 2**20
    speed = [f"| {name} | {', '.join(f'{t:.3f}' for t in times)} | "
             f"{statistics.median(times):.3f} |" for name, times in results["speed"].items()]
    ratio = (statistics.median(results["speed"]["fsdp2"])
             / statistics.median(results["speed"]["ddp"]))
    whole = results["memory"][("ddp", 1)]["state"]
    rows = []
    for (name, dp), m in results["memory"].items():
        rows.append(f"| {name} | {dp} | {m['state'] * mib:.1f} | {m['state'] / whole:.3f} | "
                    f"{m['peak'] * mib:.1f} | {m['estimate'] * mib:.1f} | "
                    f"{m['estimate'] / m['peak']:.2f} |")
    params = whole / 16 / 1e6  # fp32 params + grads + two Adam moments: 16 bytes each
    return TEMPLATE.format(
        date=datetime.date.today().isoformat(), command=command, first=WARMUP + 1,
        iters=iters, rounds=rounds, load_before=results["load_before"],
        load_after=results["load_after"], speed="\n".join(speed), speed_ratio=ratio,
        params=params, memory="\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating speed rounds")
    parser.add_argument("--iters", type=int, default=8, help="iterations per speed run")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    command = "python benchmarks/bench_fsdp2.py" + (
        f" --rounds {args.rounds}" if args.rounds != 3 else "") + (
        f" --iters {args.iters}" if args.iters != 8 else "")
    text = report(measure(args.rounds, args.iters), args.rounds, args.iters, command)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
