"""The pipeline schedules side by side on gloo ranks: each rank's idle fraction from the
executor's own trace, tokens/s of the whole step, and the activation memory the estimate
predicts against what the step measured; at pp 2 and pp 4 (one thread per rank).

Every rank builds one run per schedule (the same GPT, seed and data; interleaved schedules cut
it into two chunks per rank, zbv and dualpipev into their V), then runs their steps round-robin,
so all schedules see the same machine load; the median round is reported. A step here is
forward and backward of one global batch (``run_schedule``: no optimizer step, which every
schedule shares).

Idle fraction: ``1 - compute / wall`` of the executor's call on that rank, ``compute`` being the
time inside forward, backward, I and W (``ExecutionTrace.idle_fraction``): the bubble as the rank
lived it, communication included. Simulated: the same lists with F = I = W = 1 per action; and
predicted: the same lists simulated with each action's measured cost (the median F, B, I or W
of that rank and chunk; the first and last stages carry the embedding and the loss), as
``1 - work / end`` of each rank, the measured idle's definition: what the simulator predicts
given what the actions cost (communication free).

Memory, one step per schedule after the timing: the peak of live torch CPU allocations during
the step over what was live at its start (torch.profiler's memory events), and the resident-set
high-water mark over the step's start (after ``malloc_trim``); against the estimate's
activations plus workspace for the rank (``plugtron estimate``).

    .venv/bin/python benchmarks/bench_pipeline_schedules.py [--rounds 7] [--no-record]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import re
import statistics
import sys

import torch
from probes import live_peak_bytes
from results import write_section

SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "interleaved-zero-bubble", "zbv",
             "dualpipev"]
LOOPED_CHUNKS = {"interleaved-1f1b": 2, "interleaved-zero-bubble": 2}
MODEL = {"model": "gpt", "num-layers": 8, "hidden-size": 256, "num-attention-heads": 8,
         "seq-length": 128, "max-position-embeddings": 128, "vocab-size": 1024,
         "micro-batch-size": 2, "hidden-dropout": 0.0, "attention-dropout": 0.0,
         "train-iters": 1, "eval-interval": 0, "progress": False, "log-interval": 0}
MICROBATCHES = 8


def _flags(schedule: str, pp: int, hidden: int, seq: int) -> dict:
    flags = {**MODEL, "pp": pp, "schedule": schedule, "hidden-size": hidden, "seq-length": seq,
             "max-position-embeddings": seq,
             "global-batch-size": MICROBATCHES * MODEL["micro-batch-size"]}
    if schedule in LOOPED_CHUNKS:
        flags["vp"] = LOOPED_CHUNKS[schedule]
    return flags


def _microbatches(run):
    g = torch.Generator().manual_seed(0)
    m, mbs = run.config.model, run.config.training.micro_batch_size
    out = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, m.vocab_size, (mbs, m.seq_length), generator=g)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1),
                    "loss_mask": torch.ones(mbs, m.seq_length),
                    "position_ids": torch.arange(m.seq_length).expand(mbs, -1)})
    return out


def _step(run, micro):
    from plugtron.core.training.loop import run_schedule

    for chunk in run.model_chunks:
        chunk.zero_grad_buffer()
    run_schedule(run, [iter(micro) for _ in run.model_chunks], forward_only=False)


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


def _memory(run, micro) -> tuple[int, int]:
    """(peak live torch bytes over the step's start, peak RSS over the step's start)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _kib("VmRSS") * 1024
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        _step(run, micro)
    rss = _kib("VmHWM") * 1024 - rss0
    return live_peak_bytes(prof), rss


def rank_main(rank, world_size, rounds, hidden, seq):
    from plugtron.core.pipeline import executor
    from plugtron.core.tools.estimate import estimate_memory
    from plugtron.core.training.loop import setup
    from plugtron.testing.config import make_config

    torch.set_num_threads(1)
    runs = {}
    for name in SCHEDULES:
        config = make_config(_flags(name, world_size, hidden, seq))
        config.plugins.disabled = ["no:logging"]
        run = setup(config)
        runs[name] = (run, _microbatches(run))
    walls = {name: [] for name in SCHEDULES}
    idle = {name: [] for name in SCHEDULES}
    seconds: dict = {name: {} for name in SCHEDULES}  # kind -> every action's seconds
    for step in range(rounds + 1):  # the first round warms up
        order = SCHEDULES if step % 2 else SCHEDULES[::-1]
        for name in order:
            run, micro = runs[name]
            torch.distributed.barrier(group=run.parallel.pp_group)
            _step(run, micro)
            if step:
                walls[name].append(executor.last_trace.wall_seconds)
                idle[name].append(executor.last_trace.idle_fraction)
                for key, spent in executor.last_trace.action_seconds.items():
                    seconds[name].setdefault(key, []).extend(spent)
    memory = {}
    for name in SCHEDULES:
        run, micro = runs[name]
        live, rss = _memory(run, micro)
        estimate = estimate_memory(run.config, world_size, cuda=False)
        mine = next(r for r in estimate.ranks if rank in r.ranks)
        # Live tensors against activations + backward's transient + receive buffers; the
        # resident set against those and the CPU heap's slack too.
        live_estimate = mine.activation_bytes + mine.workspace_bytes
        memory[name] = {"live": live, "rss": rss, "estimate": live_estimate,
                        "estimate_rss": live_estimate + mine.heap_slack_bytes}
    costs = {name: {key: statistics.median(spent) for key, spent in by_kind.items()}
             for name, by_kind in seconds.items()}
    return {"walls": walls, "idle": idle, "memory": memory, "costs": costs}


def simulated(name: str, pp: int) -> float:
    from plugtron.cli.schedule_cmd import describe_schedule

    report, _ = describe_schedule(name, pp, LOOPED_CHUNKS.get(name), MICROBATCHES)
    return report["bubble_fraction"]


def predicted_idle(name: str, pp: int, per_rank: list[dict]) -> list[float]:
    """Each rank's ``1 - work / end`` of the schedule simulated with every action's measured
    cost (that rank's and chunk's median of its kind)."""
    from plugtron.cli.schedule_cmd import describe_schedule
    from plugtron.core.pipeline.plan import simulate

    report, _ = describe_schedule(name, pp, LOOPED_CHUNKS.get(name), MICROBATCHES)
    per_rank_actions = [[_action(a) for a in r["actions"]] for r in report["ranks"]]

    def cost(rank, action):
        return per_rank[rank]["costs"][name][(action.kind, action.chunk)]

    chunks = 2 if report["vp"] or report["pipeline_placement"] != "looped" else 1
    slots = simulate(per_rank_actions, chunks, placement=report["pipeline_placement"],
                     action_cost=cost)
    return [1.0 - sum(x.end - x.start for x in rank) / max(x.end for x in rank)
            for rank in slots]


def _action(entry: dict):
    from plugtron.core.pipeline.plan import Action

    return Action(**entry)


def measure(pp: int, rounds: int, hidden: int, seq: int) -> list[dict]:
    from plugtron.testing import DistributedPool

    with DistributedPool(pp, timeout=1800) as pool:
        per_rank = pool.run(rank_main, rounds, hidden, seq, world_size=pp)
    tokens = MICROBATCHES * MODEL["micro-batch-size"] * seq
    rows = []
    for name in SCHEDULES:
        # a step ends with its slowest rank: per round the max over ranks, then the median
        step = statistics.median(max(r["walls"][name][i] for r in per_rank)
                                 for i in range(rounds))
        rows.append({
            "schedule": name, "pp": pp, "step": step, "tokens_per_s": tokens / step,
            "idle": [statistics.median(r["idle"][name]) for r in per_rank],
            "simulated": simulated(name, pp),
            "predicted": predicted_idle(name, pp, per_rank),
            "memory": [r["memory"][name] for r in per_rank]})
    base = next(r for r in rows if r["schedule"] == "1f1b")["step"]
    for row in rows:
        row["vs_1f1b"] = base / row["step"]
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    lines = ["| pp | schedule | step (s) | tokens/s | speed vs 1f1b | idle fraction per rank "
             "(measured) | idle per rank predicted from the measured action costs | bubble "
             "(simulated, unit costs) | estimate / live peak per rank | estimate / RSS peak per "
             "rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        live = " ".join(f"{m['estimate'] / m['live']:.2f}" for m in r["memory"])
        rss = " ".join(f"{m['estimate_rss'] / m['rss']:.2f}" for m in r["memory"])
        idle = " ".join(f"{x:.3f}" for x in r["idle"])
        predicted = " ".join(f"{x:.3f}" for x in r["predicted"])
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {r['step']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['vs_1f1b']:.2f} | {idle} | {predicted} | {r['simulated']:.3f} | "
            f"{live} | {rss} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=MODEL["hidden-size"])
    parser.add_argument("--seq", type=int, default=MODEL["seq-length"])
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    rows = [row for pp in args.pp for row in measure(pp, args.rounds, args.hidden, args.seq)]
    lines = format_rows(rows)
    print("\n".join(lines))
    if not args.no_record:
        m = {**MODEL, "hidden-size": args.hidden, "seq-length": args.seq}
        default = (args.hidden, args.seq) == (MODEL["hidden-size"], MODEL["seq-length"])
        which = "" if default else f", hidden {args.hidden} x seq {args.seq}"
        write_section(
            f"\n## Pipeline schedules measured{which} ({datetime.date.today()})\n\n"
            f"Machine: 2-core Intel Xeon VM (AVX-512, AMX), gloo, one thread per rank; pp 4 "
            f"runs 4 ranks on the 2 cores (oversubscribed: a rank's idle time there includes "
            f"waiting for a core).\n\n"
            f"Command: `.venv/bin/python benchmarks/bench_pipeline_schedules.py "
            f"--rounds {args.rounds} --pp {' '.join(map(str, args.pp))}"
            f"{'' if default else f' --hidden {args.hidden} --seq {args.seq}'}`\n\n"
            f"GPT {m['num-layers']} layers, hidden {m['hidden-size']}, seq {m['seq-length']}, "
            f"vocab {m['vocab-size']}, micro batch {m['micro-batch-size']}, {MICROBATCHES} "
            f"microbatches, fp32, dp 1. Step: forward and backward of one global batch (median "
            f"round, slowest rank), all schedules round-robin in the same processes. Idle "
            f"fraction: 1 - compute / wall of the executor on that rank, from its trace. "
            f"Predicted: the same per-rank lists simulated with every action's measured cost "
            f"(that rank's and chunk's median F, B, I or W), free communication, as 1 - work / "
            f"end per rank. Simulated: F = I = W = 1 per action. Memory: the estimate's "
            f"activations + backward transient + receive buffers over the step's measured peak "
            f"of live torch allocations (what a GPU's allocator counts); and with the CPU heap's "
            f"slack over the step's resident-set peak.\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
