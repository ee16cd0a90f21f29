"""fsdp2 against ddp side by side, in one run: step time at dp 2 on the same model (rounds
alternate between the two, so both see the same machine load), and per-rank memory of a model
that dominates memory at dp 4: bytes of parameters + gradients + optimizer state read off the
tensors, the peak resident set of the step, and ``plugtron estimate``'s figure for it.

    .venv/bin/python benchmarks/bench_fsdp2.py            # writes its section of RESULTS.md
    .venv/bin/python benchmarks/bench_fsdp2.py --no-write --rounds 2

Every rank is a gloo process with one intra-op thread. Memory runs each start a fresh pool; the
figure is the resident-set high-water mark of the training steps (VmHWM, reset after ``setup``
and ``malloc_trim``) over the resident set just before ``setup``: the runtime, torch and
plugtron's imports left out, as the estimate leaves them out, and the build's transient too
(every rank builds the whole fp32 model before the wrapper shards it).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import statistics
import sys

from probes import StepTimes, live_peak_bytes
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
                "seq-length": 64, "micro-batch-size": 1, "global-batch-size": 8,
                "vocab-size": 1024, "make-vocab-size-divisible-by": 128}
WRAPPERS = {"ddp": {"data-parallel": "ddp"},
            "ddp + distributed optimizer": {"data-parallel": "ddp",
                                            "use-distributed-optimizer": True},
            "fsdp2": {"use-torch-fsdp2": True},
            "fsdp2, no reshard after forward": {"use-torch-fsdp2": True,
                                                "torch-fsdp2-reshard-after-forward": False}}
#: Tokens per rank and step: 1024 (seq 128) and 4096 (seq 512); fsdp2's gathers and
#: reductions depend on the parameters only, so their share falls as the tokens grow.
SPEED_SEQS = (128, 512)
SPEED_WRAPPERS = ("ddp", "fsdp2", "fsdp2, no reshard after forward")
WARMUP = 2


def _buffer_bytes(run) -> int:
    """ddp's gradient buffers, which live across steps (fsdp2 frees its gradients)."""
    return sum(b.grad_data.numel() * b.grad_data.element_size()
               for chunk in run.model_chunks for b in getattr(chunk, "grad_buffers", ()))


def _high_water_bytes() -> int:
    """VmHWM of /proc/self/status: the resident-set peak since the last reset."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train(rank, world_size, flags: dict, iters: int, memory: bool = False) -> dict:
    """In each pool rank: a short run; its step times, state bytes and resident-set peak."""
    import torch
    from plugtron.api import local_tensor
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.training.loop import setup, train

    torch.set_num_threads(1)
    config = config_from_flags({**flags, "train-iters": iters}, "benchmark")
    recorder = StepTimes()
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
    # The training peak, not the build's: every rank builds the whole fp32 model before
    # wrapping it (fsdp2 frees all but its shard at once), so hand freed heap back to the
    # system and restart the high-water mark after setup.
    peak = live_peak = live_start = 0
    if not memory:
        train(run, MetricsLogger(config, rank=1))
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        config.training.train_iters = iters - 1
        train(run, MetricsLogger(config, rank=1))
        peak = _high_water_bytes()  # before the profiler, which holds memory of its own
        # The last iteration under the profiler: the peak of live tensor bytes (what the estimate
        # counts) over those live at its start (parameters, optimizer state, ddp's buffers).
        live_start = (sum(local_tensor(p).numel() * p.element_size()
                          for chunk in run.model_chunks for p in chunk.parameters())
                      + run.optimizer.state_bytes() + _buffer_bytes(run))
        config.training.train_iters = iters
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            train(run, MetricsLogger(config, rank=1))
        live_peak = live_peak_bytes(prof)
    params = sum(local_tensor(p).numel() * p.element_size()
                 for chunk in run.model_chunks for p in chunk.parameters())
    timed = recorder.times[WARMUP:] or recorder.times
    return {"step_s": statistics.median(timed), "times": recorder.times,
            "state_bytes": params + grads[-1] + run.optimizer.state_bytes(),
            "peak_over_start": peak - before, "live_peak": live_start + live_peak}


def _estimate(flags: dict, world: int) -> tuple[int, int]:
    """(without the CPU heap's slack: against live tensors; the CPU total: against RSS)."""
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.tools.estimate import estimate_memory

    peak = estimate_memory(config_from_flags(flags, "benchmark"), world, cuda=False).peak
    return peak.total - peak.heap_slack_bytes, peak.total


def measure(rounds: int, iters: int) -> dict:
    from plugtron.testing import DistributedPool

    out: dict = {"load_before": os.getloadavg()[0],
                 "speed": {(seq, name): [] for seq in SPEED_SEQS for name in SPEED_WRAPPERS}}
    with DistributedPool(2, timeout=1800) as pool:
        for _ in range(rounds):
            for seq in SPEED_SEQS:
                for name in SPEED_WRAPPERS:
                    flags = {**SPEED_MODEL, **WRAPPERS[name], "seq-length": seq}
                    ranks = pool.run(_train, flags, iters)
                    out["speed"][(seq, name)].append(max(r["step_s"] for r in ranks))
    memory = {}
    for name, flags in WRAPPERS.items():
        for dp in (1, 4):
            if dp == 1 and name != "ddp" or name == "ddp" and dp == 4:
                continue
            with DistributedPool(dp, timeout=1800) as pool:
                ranks = pool.run(_train, {**MEMORY_MODEL, **flags}, 3, True)
            memory[(name, dp)] = {
                "state": max(r["state_bytes"] for r in ranks),
                "peak": max(r["peak_over_start"] for r in ranks),
                "live": max(r["live_peak"] for r in ranks),
                "estimates": _estimate({**MEMORY_MODEL, **flags}, dp)}
    out["memory"] = memory
    out["load_after"] = os.getloadavg()[0]
    return out


TEMPLATE = """## fsdp2 against ddp: speed and memory per rank ({date})

Machine: 2-core CPU (AVX-512, AMX), gloo, one intra-op thread per rank; 1-minute load average
{load_before:.1f} at the start, {load_after:.1f} at the end. Command: `{command}`

**Speed**, dp 2, the same model (4 layers, hidden 256, vocab 512, global batch 16, micro batch
4: two microbatches per rank, fp32) at seq 128 and seq 512 (1024 and 4096 tokens per rank and
step): median step time of iterations {first}-{iters}, slower rank, {rounds} rounds that
alternate between the wrappers.

| seq | wrapper | step time per round (s) | median (s) | x ddp |
|---|---|---|---|---|
{speed}

fsdp2 (default, parameters resharded after forward) gathers each layer before its forward and
again before its backward and reduce-scatters every microbatch's gradients; ddp all-reduces
once per step. Those costs depend on the parameters, not the tokens, so fsdp2's ratio falls as
the tokens per step grow. `--torch-fsdp2-no-reshard-after-forward` gathers once and
reduce-scatters once per step, keeping whole parameters and gradients during the step. The
target was <= 1.15x.

**Memory per rank**, a model that dominates memory: 8 layers, hidden 1024, vocab 1024
({params:.1f}M parameters), seq 64, micro batch 1, global batch 8 (two microbatches per rank at
dp 4), fp32, Adam, three iterations. "state": parameters + gradients + optimizer state read off
the tensors (their local shards) at the optimizer step. "live peak": the most bytes of live
tensors during the last iteration (torch.profiler's memory events over what lived at its start:
parameters, optimizer state, ddp's gradient buffers), which is what the estimate counts. "peak
RSS": the resident-set high-water mark of the iterations before that one over the resident set
before setup (not the build: every rank builds the whole fp32 model, {build:.0f} MiB here,
before fsdp2 keeps its shard). "estimate": `plugtron estimate`'s total for the rank, against the
live peak without the CPU heap's slack, against the RSS with it.

| wrapper | dp | state MiB | x dp 1 | live peak MiB | peak RSS MiB | estimate MiB | estimate / live | estimate / RSS |
|---|---|---|---|---|---|---|---|---|
{memory}
"""


def report(results: dict, rounds: int, iters: int, command: str) -> str:
    mib = 1 / 2**20
    speed = []
    for (seq, name), times in results["speed"].items():
        ratio = statistics.median(times) / statistics.median(results["speed"][(seq, "ddp")])
        speed.append(f"| {seq} | {name} | {', '.join(f'{t:.3f}' for t in times)} | "
                     f"{statistics.median(times):.3f} | {ratio:.2f} |")
    whole = results["memory"][("ddp", 1)]["state"]
    rows = []
    for (name, dp), m in results["memory"].items():
        rows.append(f"| {name} | {dp} | {m['state'] * mib:.1f} | {m['state'] / whole:.3f} | "
                    f"{m['live'] * mib:.1f} | {m['peak'] * mib:.1f} | "
                    f"{m['estimates'][0] * mib:.1f} | {m['estimates'][0] / m['live']:.2f} | "
                    f"{m['estimates'][1] / m['peak']:.2f} |")
    params = whole / 16 / 1e6  # fp32 params + grads + two Adam moments: 16 bytes each
    return TEMPLATE.format(
        date=datetime.date.today().isoformat(), command=command, first=WARMUP + 1,
        iters=iters, rounds=rounds, load_before=results["load_before"],
        load_after=results["load_after"], speed="\n".join(speed),
        params=params, memory="\n".join(rows), build=whole / 4 * mib)


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
