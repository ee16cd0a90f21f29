"""plugtron's 1f1b and interleaved-1f1b against torch.distributed.pipelining's Schedule1F1B and
ScheduleInterleaved1F1B, in one run: the same GPT stages (the very same modules), the same
microbatches, world size 2 (pp 2), gloo on CPU.

Measured per schedule: the fastest step time (forward and backward of one global batch, no
optimizer step), with the two libraries' steps alternating so both see the same machine load, and
the bubble fraction ``1 - compute / step`` of that round, where ``compute`` is the time spent in
stage forwards, the loss and stage backwards (plugtron's executor counts it; on torch's side the
stage module, the loss function and torch's ``stage_backward`` are timed).
The fastest of several rounds is the one least disturbed by the other processes on the CPU.

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 7] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results import write_section

WORLD = 2
MODEL = {"num-layers": 8, "hidden-size": 128, "num-attention-heads": 8, "seq-length": 128,
         "vocab-size": 1024, "make-vocab-size-divisible-by": 8, "micro-batch-size": 2,
         "global-batch-size": 16, "hidden-dropout": 0.0, "attention-dropout": 0.0,
         "data": "mock", "train-iters": 1, "eval-interval": 0, "progress": False,
         "log-interval": 0, "pp": WORLD}
MICROBATCHES = 8


def build_run(rank: int, vp: int | None):
    from plugtron.core.parallel.distributed import WorldInfo
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.training.loop import setup

    config = config_from_flags(dict(MODEL, **({"vp": vp} if vp else {})), "benchmark")
    config.plugins.disabled = ["no:logging"]
    return setup(config, world=WorldInfo(rank, WORLD, rank, WORLD, torch.device("cpu")))


#: Seconds torch's side spent in forward, loss and backward (plugtron's executor counts its own).
TORCH_COMPUTE = [0.0]


def timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TORCH_COMPUTE[0] += time.perf_counter() - start
    return wrapper


def time_torch_backward() -> None:
    """torch's stages call ``stage_backward`` through their module: count its time."""
    import torch.distributed.pipelining.stage as stage_module

    if not getattr(stage_module.stage_backward, "timed", False):
        stage_module.stage_backward = timed(stage_module.stage_backward)
        stage_module.stage_backward.timed = True


class TorchStage(torch.nn.Module):
    """One plugtron GPT chunk behind the single-input interface torch's PipelineStage calls."""

    def __init__(self, gpt, positions):
        super().__init__()
        self.gpt, self.positions = gpt, positions

    @timed
    def forward(self, x):
        if self.gpt.pre_process:
            return self.gpt(x, self.positions)
        self.gpt.set_input_tensor(x)
        return self.gpt(None, self.positions)  # logits on the last stage


def batches(run):
    """The same M microbatches for both libraries."""
    g = torch.Generator().manual_seed(0)
    m = run.config.model
    mbs = run.config.training.micro_batch_size
    tokens = torch.randint(0, m.vocab_size, (MICROBATCHES * mbs, m.seq_length), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(m.seq_length).expand(mbs, -1)
    micro = [{"tokens": t, "labels": lab, "loss_mask": torch.ones_like(t, dtype=torch.float32),
              "position_ids": positions} for t, lab in zip(tokens.split(mbs), labels.split(mbs))]
    return tokens, labels, positions, micro


def plugtron_step(run, micro):
    from plugtron.core.pipeline import executor as pipeline_executor
    from plugtron.core.training.loop import run_schedule

    for chunk in run.model_chunks:
        chunk.zero_grad_buffer()
    reports = run_schedule(run, [iter(micro) for _ in run.model_chunks], forward_only=False)
    loss = sum(float(r["lm loss"][0]) for r in reports)
    return loss, pipeline_executor.last_trace.compute_seconds


def torch_schedule(run, positions):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    par = run.parallel
    stages = [PipelineStage(TorchStage(chunk.module, positions), c * WORLD + par.pp_rank,
                            WORLD * len(run.model_chunks), torch.device("cpu"),
                            group=par.pp_group)
              for c, chunk in enumerate(run.model_chunks)]
    vocab = run.config.model.vocab_size

    @timed
    def loss_fn(logits, target):  # the loss plugtron's last stage computes, summed
        return run.backend.cross_entropy(logits, target, vocab).sum()

    if len(stages) == 1:
        return Schedule1F1B(stages[0], MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)


def torch_step(run, schedule, tokens, labels):
    for chunk in run.model_chunks:
        chunk.module.zero_grad(set_to_none=True)
    losses = []
    TORCH_COMPUTE[0] = 0.0
    if run.parallel.pp_rank == 0:
        schedule.step(tokens)
    else:
        schedule.step(target=labels, losses=losses)
    return sum(float(x.detach()) for x in losses), TORCH_COMPUTE[0]


def measure(rank, vp, steps):
    run = build_run(rank, vp)
    tokens, labels, positions, micro = batches(run)
    schedule = torch_schedule(run, positions)
    time_torch_backward()
    rounds = {"plugtron": [], "torch": []}  # (wall, compute) seconds per step
    losses = {}
    for step in range(steps + 2):  # two warm-up rounds (torch infers shapes on its first)
        # Alternate who goes first, so neither side always follows the other's traffic.
        for side in ("plugtron", "torch") if step % 2 else ("torch", "plugtron"):
            dist.barrier(group=run.parallel.pp_group)
            start = time.perf_counter()
            if side == "plugtron":
                losses[side], compute = plugtron_step(run, micro)
            else:
                losses[side], compute = torch_step(run, schedule, tokens, labels)
            if step >= 2:
                rounds[side].append((time.perf_counter() - start, compute))
    if os.environ.get("BENCH_VERBOSE"):
        print(f"rank {rank} vp {vp}: {rounds}", file=sys.stderr)
    # The CPU is shared: the fastest round is the one least disturbed by other processes, and
    # the two sides of one round (run back to back) saw about the same load.
    best = {side: min(r) for side, r in rounds.items()}
    return {"times": {side: b[0] for side, b in best.items()},
            "bubble": {side: 1 - b[1] / b[0] for side, b in best.items()},
            "walls": {side: [r[0] for r in rs] for side, rs in rounds.items()},
            "losses": losses}


def worker(rank, init_file, steps, queue):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    out = {vp or 1: measure(rank, vp, steps) for vp in (None, 2)}
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def simulated_bubble(vp: int) -> float:
    from plugtron.core.pipeline.plan import bubble_fraction, simulate
    from plugtron.plugins.schedules.interleaved import interleaved_actions
    from plugtron.plugins.schedules.one_f_one_b import one_f_one_b_actions

    if vp == 1:
        lists = [one_f_one_b_actions(r, WORLD, MICROBATCHES) for r in range(WORLD)]
    else:
        lists = [interleaved_actions(r, WORLD, vp, MICROBATCHES, WORLD) for r in range(WORLD)]
    return bubble_fraction(simulate(lists, vp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "store"), args.steps,
                                                   queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    rows = []
    for vp, (ours, theirs) in ((1, ("1f1b", "Schedule1F1B")),
                               (2, ("interleaved-1f1b", "ScheduleInterleaved1F1B"))):
        per_rank = [results[r][vp] for r in range(WORLD)]
        # A step ends when the slowest rank ends: report rank-max step times.
        t_ours = max(r["times"]["plugtron"] for r in per_rank)
        t_theirs = max(r["times"]["torch"] for r in per_rank)
        # Per round, the step ends with the slowest rank; the median of the paired ratios.
        walls = {side: [max(w) for w in zip(*(r["walls"][side] for r in per_rank))]
                 for side in ("plugtron", "torch")}
        ratio = statistics.median(p / t for p, t in zip(walls["plugtron"], walls["torch"]))
        bubble = {side: statistics.mean(r["bubble"][side] for r in per_rank)
                  for side in ("plugtron", "torch")}
        loss = per_rank[-1]["losses"]
        rows.append((vp, ours, theirs, t_ours, t_theirs, ratio, bubble, simulated_bubble(vp),
                     loss))
    lines = format_rows(rows)
    print("\n".join(lines))
    if not args.no_record:
        record(lines)


def format_rows(rows) -> list[str]:
    m = MODEL
    setup = (f"GPT {m['num-layers']} layers, hidden {m['hidden-size']}, seq {m['seq-length']}, "
             f"vocab {m['vocab-size']}, micro batch {m['micro-batch-size']}, {MICROBATCHES} "
             f"microbatches, pp {WORLD} (world {WORLD}, 1 thread per rank), fp32; step = "
             f"forward + backward of one global batch, fastest of the measured rounds, slowest "
             f"rank; paired ratio = median over rounds of plugtron / torch run back to back.")
    header = ("| vp | plugtron | torch.distributed.pipelining | plugtron step (s) | torch step "
              "(s) | ratio of fastest | median paired ratio | bubble plugtron | bubble torch "
              "| simulated bubble | loss plugtron / torch |")
    lines = [setup, "", header,
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for vp, ours, theirs, t_ours, t_theirs, ratio, bubble, sim, loss in rows:
        lines.append(f"| {vp} | {ours} | {theirs} | {t_ours:.3f} | {t_theirs:.3f} | "
                     f"{t_ours / t_theirs:.3f} | {ratio:.3f} | {bubble['plugtron']:.3f} | "
                     f"{bubble['torch']:.3f} | {sim:.3f} | "
                     f"{loss['plugtron']:.2f} / {loss['torch']:.2f} |")
    return lines


def record(lines) -> None:
    write_section(f"\n## Pipeline schedules: plugtron vs torch.distributed.pipelining "
                  f"({datetime.date.today()})\n\n"
                  f"Machine: 2-core CPU, gloo. The CPU was shared with other engineers' test runs "
                  f"while measuring, so absolute times are noisy; the two libraries' steps "
                  f"alternate, so the ratios see the same load.\n\n"
                  f"Command: `.venv/bin/python benchmarks/bench_pipeline.py`\n\n"
                  f"Bubble = 1 - (time in stage forward, loss and backward) / step time in the "
                  f"same round, averaged over ranks: idle and communication time. Simulated: "
                  f"forward 1, backward 2, free communication.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
