"""Context-parallel attention side by side: cp 1, 2, 4 x p2p / allgather / a2a.

One causal attention layer (forward + backward of ``context_parallel_attention``, the call every
layer backend's core_attention makes) on gloo ranks, one thread per rank (or NCCL GPUs when
``--cuda``):

1. At ``--seq`` (default 4096): step time, tokens/s (the whole sequence over the step time), the
   attention activations each rank keeps for backward (bytes saved by autograd, counted with
   saved-tensor hooks, each storage once) against 1/cp of cp 1's, and the peak memory of the
   step per rank: on CPU the rise of the process's peak resident set (VmHWM, reset before the
   step through /proc/self/clear_refs after malloc_trim) over its resident set before; on CUDA
   the peak allocated bytes.
2. p2p overlap, at ``--seq`` and ``--overlap-seq``: the ring's step time against its compute
   alone (the same blocks, transfers replaced by a local copy) and its communication alone (the
   same transfers, no compute). Overlap shows as ring < compute + communication.
3. The longest sequence within a per-rank cap, cp 1 against cp 4 (each comm type), doubling:
   by attention activations (``--cap-mib``, forward only) and by the step's peak memory
   (``--peak-cap-mib``, p2p, forward + backward).
4. ``--model``: the same question for a whole training step of a small GPT model
   (``MODEL_FLAGS``: 8 layers, so the activations every layer keeps for backward dominate, not
   one attention call's transient blocks): the longest sequence whose second training step stays
   within ``--model-cap-mib`` of peak RSS rise per rank (doubling from ``--model-start``),
   cp 1 against cp 4 p2p and a2a, with the step's peak and tokens/s at the lengths found
   (``--model-repeats`` alternating rounds there, medians). Only this part runs with
   ``--model``.

Rounds alternate between configurations (each round runs every configuration once, after one
warm-up round) and the medians are reported. Appends a section to benchmarks/RESULTS.md with
``--write``. Usage:
``python benchmarks/bench_context_parallel.py [--seq 4096] [--repeats 3] [--write]``,
``python benchmarks/bench_context_parallel.py --model [--model-cap-mib 192] [--write]``
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_tensor_parallel.py
# Allocations above 1 MiB are mmapped and returned on free (glibc's threshold otherwise grows to
# the largest block freed, keeping later ones in the heap), so the resident set follows the live
# memory; the spawned ranks inherit it.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from plugtron.api import ParallelContext, hookimpl  # noqa: E402
from plugtron.core.parallel import cp_attention  # noqa: E402 - patches its private ring exchange
from plugtron.core.parallel.context_parallel import split_tensor  # noqa: E402
from results import write_section  # noqa: E402

from tests.distributed.harness import DistributedPool, worker_cache  # noqa: E402

HEADS, GROUPS, DIM, BATCH = 8, 8, 64, 1
COMM_TYPES = ("p2p", "allgather", "a2a")


def _parallel(rank, world_size, cuda):
    cache = worker_cache()
    key = ("cp", world_size)
    if key not in cache:
        torch.set_num_threads(1)
        device = f"cuda:{rank}" if cuda else "cpu"
        cache[key] = ParallelContext.build(world_size, rank, cp=world_size, device=device)
    return cache[key]


def _inputs(seq, parallel, cuda):
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(BATCH, seq, h, DIM, generator=gen) for h in (HEADS, GROUPS, GROUPS)]
    device = f"cuda:{parallel.rank}" if cuda else "cpu"
    return [split_tensor(t, 1, parallel.cp_rank, parallel.cp_size).to(device).requires_grad_()
            for t in full]


def _saved_bytes(fn):
    """Bytes autograd keeps for backward while ``fn`` runs (each storage once)."""
    seen = set()

    def pack(t):
        storage = t.untyped_storage()
        seen.add((storage.data_ptr(), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(nbytes for _, nbytes in seen)


class _PeakMemory:
    """Peak memory of a region above its start: CUDA peak allocated, or on CPU the rise of the
    peak resident set (Linux: /proc/self/clear_refs resets VmHWM to the current RSS)."""

    def __init__(self, cuda):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system first
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = _status_bytes("VmHWM") - self.start


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


class _LocalExchange:
    """Stands in for the ring's transfer: hands back a copy of the block sent."""

    def __init__(self, tensor, *args):
        self.received = tensor.clone()

    def wait(self):
        return self.received


def _ring_transfers_only(q, k, v, parallel):
    """The ring's messages without its compute: cp-1 K/V hops forward; cp-1 K/V hops and cp
    dK/dV hops (fp32) backward."""
    cp, ranks, rank = parallel.cp_size, parallel.cp_ranks, parallel.cp_rank
    kv = torch.stack([k.detach(), v.detach()]).transpose(2, 3)
    grad = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for _ in range(2):  # forward, then backward's K/V
        for _ in range(cp - 1):
            kv = cp_attention._RingExchange(kv, ranks, rank, parallel.cp_group, 10).wait()
    for _ in range(cp):
        grad = cp_attention._RingExchange(grad, ranks, rank, parallel.cp_group, 11).wait()


def _rank_step(rank, world_size, seq, comm_type, cuda, mode="full"):
    """One fwd+bwd: (seconds, bytes saved for backward, peak bytes of the step)."""
    parallel = _parallel(rank, world_size, cuda)
    q, k, v = _inputs(seq, parallel, cuda)
    real_exchange = cp_attention._RingExchange
    if mode == "compute":
        cp_attention._RingExchange = _LocalExchange
    try:
        saved = 0
        _sync(cuda)
        if world_size > 1:
            torch.distributed.barrier()
        with _PeakMemory(cuda) as memory:
            start = time.perf_counter()
            if mode == "comm":
                _ring_transfers_only(q, k, v, parallel)
            else:
                out, saved = _saved_bytes(lambda: cp_attention.context_parallel_attention(
                    q, k, v, parallel, comm_type))
                out.sum().backward()
                del out
            _sync(cuda)
            seconds = time.perf_counter() - start
    finally:
        cp_attention._RingExchange = real_exchange
    return seconds, saved, memory.peak


def _rank_saved_only(rank, world_size, seq, comm_type, cuda):
    parallel = _parallel(rank, world_size, cuda)
    q, k, v = _inputs(seq, parallel, cuda)
    _, saved = _saved_bytes(lambda: cp_attention.context_parallel_attention(
        q, k, v, parallel, comm_type))
    return saved


def _alternating(pool, configs, repeats, cuda):
    """``configs``: {name: (cp, seq, comm_type, mode)}. One warm-up round, then ``repeats``
    rounds each running every configuration once; per configuration the medians over rounds of
    the slowest rank's time, the largest saved bytes and the largest peak."""
    samples = {name: [] for name in configs}
    for round_ in range(repeats + 1):
        for name, (cp, seq, comm_type, mode) in configs.items():
            res = pool.run(_rank_step, seq, comm_type, cuda, mode, world_size=cp)
            if round_:
                samples[name].append((max(r[0] for r in res), max(r[1] for r in res),
                                      max(r[2] for r in res)))
            print(name, res, flush=True)
    return {name: tuple(statistics.median(s[i] for s in rows) for i in range(3))
            for name, rows in samples.items()}


def _longest(pool, cp, comm_type, cap, start, max_seq, cuda, by_peak):
    seq, best = start, None
    while seq <= max_seq:
        if by_peak:
            used = max(r[2] for r in pool.run(_rank_step, seq, comm_type, cuda, world_size=cp))
        else:
            used = max(pool.run(_rank_saved_only, seq, comm_type, cuda, world_size=cp))
        print("longest", cp, comm_type, seq, used, flush=True)
        if used > cap:
            break
        best, seq = seq, seq * 2
    return best


#: The whole-model measurement's GPT: small enough for 2 CPU cores, deep enough that the
#: activations kept across layers outweigh one attention call's transient blocks.
MODEL_FLAGS = {"num-layers": 8, "hidden-size": 64, "num-attention-heads": 4,
               "vocab-size": 128, "make-vocab-size-divisible-by": 8, "micro-batch-size": 1,
               "global-batch-size": 1, "train-iters": 2, "position-embedding-type": "rope",
               "lr": 1e-4, "min-lr": 1e-5, "lr-warmup-iters": 0}


class _SecondStep:
    """Extension plugin: the time and peak memory (as :class:`_PeakMemory`) of training step 2,
    between the ends of steps 1 and 2 (step 1 has allocated the optimizer's state)."""

    def __init__(self, cuda):
        self.memory, self.seconds = _PeakMemory(cuda), None

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        if iteration == 1:
            self.memory.__enter__()
            self.start = time.perf_counter()
        elif iteration == 2:
            self.seconds = time.perf_counter() - self.start
            self.memory.__exit__(None, None, None)


def _rank_model_step(rank, world_size, seq, comm_type, cuda):
    """Two training steps of the MODEL_FLAGS GPT at sequence ``seq`` over cp = world size:
    (seconds, peak bytes) of the second."""
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.training.loop import setup, train

    from tests.utils import tiny_config

    torch.set_num_threads(1)
    flags = {**MODEL_FLAGS, "seq-length": seq, "cp": world_size, "cp-comm-type": comm_type}
    config = tiny_config(**flags)
    probe = _SecondStep(cuda)
    run = setup(config, extra_plugins=[probe])
    train(run, MetricsLogger(config, rank=1))
    del run
    return probe.seconds, probe.memory.peak


def _longest_model(pool, cp, comm_type, cap, start, max_seq, cuda):
    """Doubling from ``start``: the longest sequence whose step-2 peak stays within ``cap``,
    with its (seconds, peak) (None, None when even ``start`` does not fit)."""
    seq, best = start, (None, None)
    while seq <= max_seq:
        res = pool.run(_rank_model_step, seq, comm_type, cuda, world_size=cp)
        seconds, peak = max(r[0] for r in res), max(r[1] for r in res)
        print("model longest", cp, comm_type, seq, seconds, peak, flush=True)
        if peak > cap:
            break
        best, seq = (seq, (seconds, peak)), seq * 2
    return best


MODEL_LAYOUTS = ((1, "p2p"), (4, "p2p"), (4, "a2a"))


def run_model(args):
    """Longest sequence per layout, then ``--model-repeats`` alternating rounds at the lengths
    found: {(cp, comm): (seq, seconds, peak)}."""
    pool = DistributedPool(4, timeout=3600, backend="nccl" if args.cuda else "gloo")
    cap = args.model_cap_mib * 2**20
    with pool:
        found = {layout: _longest_model(pool, *layout, cap, args.model_start, args.max_seq,
                                        args.cuda)[0] for layout in MODEL_LAYOUTS}
        samples = {layout: [] for layout in found if found[layout]}
        for _ in range(args.model_repeats):
            for (cp, comm_type) in samples:
                res = pool.run(_rank_model_step, found[(cp, comm_type)], comm_type, args.cuda,
                               world_size=cp)
                samples[(cp, comm_type)].append((max(r[0] for r in res),
                                                 max(r[1] for r in res)))
    return {layout: (found[layout], *(statistics.median(s[i] for s in rows) for i in range(2)))
            for layout, rows in samples.items()}


def report_model(args, figures) -> str:
    peak_name = "peak allocated" if args.cuda else "peak RSS rise"
    flags = ", ".join(f"{k} {v}" for k, v in MODEL_FLAGS.items())
    lines = [f"## Context parallelism: longest trainable sequence of a whole GPT step "
             f"({datetime.date.today()})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"shared with other engineers' builds and tests (figures are noisy), torch "
             f"{torch.__version__}. Command: `python benchmarks/bench_context_parallel.py "
             f"{' '.join(sys.argv[1:])}`. GPT ({flags}; fp32, dropout 0, local backend, Adam), "
             f"gloo ranks with one thread each. Per rank, the {peak_name} of the second training "
             f"step over the resident set at its start; sequence doubled from "
             f"{args.model_start} while within {args.model_cap_mib} MiB; then "
             f"{args.model_repeats} alternating rounds at the lengths found, medians, step = "
             f"slowest rank; tokens/s = sequence / step.", "",
             f"| cp | comm | longest sequence within {args.model_cap_mib} MiB | "
             f"{peak_name} per rank there (MiB) | step (s) | tokens/s |",
             "|---|---|---|---|---|---|"]
    for (cp, comm_type), (seq, seconds, peak) in figures.items():
        longest = f"{seq} or more (largest tried)" if seq * 2 > args.max_seq else str(seq)
        lines.append(f"| {cp} | {comm_type if cp > 1 else '-'} | {longest} | {peak / 2**20:.1f} | "
                     f"{seconds:.2f} | {seq / seconds:,.0f} |")
    return "\n".join(lines) + "\n"


def run(args):
    pool = DistributedPool(4, timeout=3600, backend="nccl" if args.cuda else "gloo")
    main = {(cp, c): (cp, args.seq, c, "full")
            for cp in (1, 2, 4) for c in (COMM_TYPES if cp > 1 else ("p2p",))}
    overlap = {}
    for seq in sorted({args.seq, args.overlap_seq}):
        for cp in (2, 4):
            for mode in ("full", "compute", "comm"):
                overlap[(cp, seq, mode)] = (cp, seq, "p2p", mode)
    with pool:
        figures = _alternating(pool, {**main, **overlap}, args.repeats, args.cuda)
        longest = {}
        for cp, comm_type in [(1, "p2p")] + [(4, c) for c in COMM_TYPES]:
            longest[("saved", cp, comm_type)] = _longest(
                pool, cp, comm_type, args.cap_mib * 2**20, 1024, args.max_seq, args.cuda, False)
        for cp in (1, 4):
            longest[("peak", cp, "p2p")] = _longest(
                pool, cp, "p2p", args.peak_cap_mib * 2**20, 2048, args.max_seq, args.cuda, True)
    return figures, longest


def report(args, figures, longest) -> str:
    base = figures[(1, "p2p")]
    device = "NCCL GPUs" if args.cuda else "gloo CPU ranks, 1 thread each"
    peak_name = "peak allocated" if args.cuda else "peak RSS rise"
    lines = [f"## Context parallelism: attention memory, speed and overlap ({datetime.date.today()})",
             "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"shared with other engineers' builds and tests (figures are noisy), torch "
             f"{torch.__version__}, {device}. Command: `python benchmarks/"
             f"bench_context_parallel.py {' '.join(sys.argv[1:])}`. One causal attention layer "
             f"(batch {BATCH}, {HEADS} heads, {GROUPS} groups, head dim {DIM}, fp32), forward + "
             f"backward; {args.repeats} alternating rounds after a warm-up, medians; step = "
             f"slowest rank.", "",
             f"### Sequence {args.seq}", "",
             f"| cp | comm | step (s) | tokens/s | activations saved per rank (MiB) | "
             f"vs cp 1 / cp | {peak_name} per rank (MiB) | vs cp 1 / cp |",
             "|---|---|---|---|---|---|---|---|"]
    for (cp, comm_type), (step, saved, peak) in ((k, v) for k, v in figures.items()
                                                  if len(k) == 2):
        lines.append(f"| {cp} | {comm_type if cp > 1 else '-'} | {step:.3f} | "
                     f"{BATCH * args.seq / step:,.0f} | {saved / 2**20:.2f} | "
                     f"{saved / (base[1] / cp):.2f}x | {peak / 2**20:.1f} | "
                     f"{peak / (base[2] / cp):.2f}x |")
    lines += ["", "### p2p overlap: ring step against its compute alone and its communication "
              "alone", "",
              "| cp | sequence | ring step (s) | compute alone (s) | communication alone (s) | "
              "sum (s) | ring / sum | communication hidden |", "|---|---|---|---|---|---|---|---|"]
    for key in figures:
        if len(key) == 3 and key[2] == "full":
            cp, seq, _ = key
            ring, compute, comm = (figures[(cp, seq, m)][0] for m in ("full", "compute", "comm"))
            hidden = (compute + comm - ring) / comm
            lines.append(f"| {cp} | {seq} | {ring:.3f} | {compute:.3f} | {comm:.3f} | "
                         f"{compute + comm:.3f} | {ring / (compute + comm):.2f} | "
                         f"{hidden:.0%} |")
    lines += ["", f"### Longest sequence within a per-rank cap (doubling, up to {args.max_seq})",
              "", "| cap | cp | comm | longest sequence |", "|---|---|---|---|"]
    for (kind, cp, comm_type), seq in longest.items():
        cap = (f"{args.cap_mib} MiB activations" if kind == "saved"
               else f"{args.peak_cap_mib} MiB {peak_name}")
        lines.append(f"| {cap} | {cp} | {comm_type if cp > 1 else '-'} | {seq} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--overlap-seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cap-mib", type=int, default=24)
    parser.add_argument("--peak-cap-mib", type=int, default=128)
    parser.add_argument("--max-seq", type=int, default=16384)
    parser.add_argument("--model", action="store_true",
                        help="only the whole-GPT-step longest-sequence measurement")
    parser.add_argument("--model-cap-mib", type=int, default=192)
    parser.add_argument("--model-start", type=int, default=1024)
    parser.add_argument("--model-repeats", type=int, default=3)
    parser.add_argument("--cuda", action="store_true", help="NCCL on 4 GPUs")
    parser.add_argument("--write", action="store_true", help="append to RESULTS.md")
    args = parser.parse_args()
    text = report_model(args, run_model(args)) if args.model else report(args, *run(args))
    print(text)
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
