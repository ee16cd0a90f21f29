"""Context-parallel attention side by side: cp 1, 2, 4 x p2p / allgather / a2a.

One causal attention layer (forward + backward of ``context_parallel_attention``, the call every
layer backend's core_attention makes) on gloo ranks, one thread per rank (or NCCL GPUs when
``--cuda``):

1. At ``--seq`` (default 4096): step time, tokens/s (the whole sequence over the step time) and
   the attention activations each rank keeps for backward (bytes saved by autograd, counted with
   saved-tensor hooks, each storage once; on CUDA also the peak allocated memory), against 1/cp
   of cp 1's.
2. p2p overlap: the ring's step time against the sum of its compute alone (the same blocks with
   the transfers replaced by a local copy) and its communication alone (the same transfers with
   no compute).
3. The longest sequence whose attention activations fit a per-rank cap (``--cap-mib``), cp 1
   against cp 4 (p2p), doubling from 1024.

Appends a section to benchmarks/RESULTS.md with ``--write``. Usage:
``python benchmarks/bench_context_parallel.py [--seq 4096] [--cap-mib 16] [--write]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_tensor_parallel.py
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from plugtron.core import cp_attention  # noqa: E402
from plugtron.core.context_parallel import split_tensor  # noqa: E402
from plugtron.core.parallel_context import ParallelContext  # noqa: E402

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
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def _rank_step(rank, world_size, seq, comm_type, repeats, cuda, mode="full"):
    """Median fwd+bwd seconds over ``repeats`` (after one warm-up), saved bytes, peak bytes."""
    parallel = _parallel(rank, world_size, cuda)
    q, k, v = _inputs(seq, parallel, cuda)
    real_exchange = cp_attention._RingExchange
    if mode == "compute":  # same blocks, transfers replaced by handing back the same block
        cp_attention._RingExchange = _LocalExchange
    times, saved, peak = [], 0, 0
    try:
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            _sync(cuda)
            if world_size > 1:
                torch.distributed.barrier()
            start = time.perf_counter()
            if mode == "comm":
                _ring_transfers_only(q, k, v, parallel)
            else:
                out, saved = _saved_bytes(lambda: cp_attention.context_parallel_attention(
                    q, k, v, parallel, comm_type))
                out.sum().backward()
            _sync(cuda)
            if i:
                times.append(time.perf_counter() - start)
            if cuda:
                peak = torch.cuda.max_memory_allocated()
    finally:
        cp_attention._RingExchange = real_exchange
    return statistics.median(times), saved, peak


class _LocalExchange:
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


def _rank_saved_only(rank, world_size, seq, comm_type, cuda):
    parallel = _parallel(rank, world_size, cuda)
    q, k, v = _inputs(seq, parallel, cuda)
    _, saved = _saved_bytes(lambda: cp_attention.context_parallel_attention(
        q, k, v, parallel, comm_type))
    return saved


def run(args):
    pool = DistributedPool(4, timeout=1800, backend="nccl" if args.cuda else "gloo")
    rows, overlap, longest = [], None, {}
    with pool:
        for cp in (1, 2, 4):
            for comm_type in (COMM_TYPES if cp > 1 else ("p2p",)):
                res = pool.run(_rank_step, args.seq, comm_type, args.repeats, args.cuda,
                               world_size=cp)
                step = max(r[0] for r in res)
                rows.append({"cp": cp, "comm": comm_type if cp > 1 else "-", "step_s": step,
                             "tokens_s": BATCH * args.seq / step,
                             "saved_mib": max(r[1] for r in res) / 2**20,
                             "peak_mib": max(r[2] for r in res) / 2**20})
                print(rows[-1], flush=True)
        cp = 4
        compute = max(r[0] for r in pool.run(_rank_step, args.seq, "p2p", args.repeats,
                                             args.cuda, "compute", world_size=cp))
        comm = max(r[0] for r in pool.run(_rank_step, args.seq, "p2p", args.repeats,
                                          args.cuda, "comm", world_size=cp))
        ring = next(r["step_s"] for r in rows if r["cp"] == cp and r["comm"] == "p2p")
        overlap = {"cp": cp, "ring": ring, "compute": compute, "comm": comm}
        print(overlap, flush=True)
        cap = args.cap_mib * 2**20
        for cp in (1, 4):
            seq, best = 1024, None
            while seq <= args.max_seq:
                saved = max(pool.run(_rank_saved_only, seq, "p2p", args.cuda, world_size=cp))
                if saved > cap:
                    break
                best, seq = seq, seq * 2
            longest[cp] = best
            print("longest", cp, best, flush=True)
    return rows, overlap, longest


def report(args, rows, overlap, longest) -> str:
    base = next(r for r in rows if r["cp"] == 1)
    device = "NCCL GPUs" if args.cuda else "gloo CPU ranks, 1 thread each"
    lines = [f"## Context parallelism: attention over cp ranks ({datetime.date.today()})", "",
             f"Machine: {platform.machine()} {os.cpu_count()} cores shared, torch "
             f"{torch.__version__}, {device}. Command: `python benchmarks/"
             f"bench_context_parallel.py {' '.join(sys.argv[1:])}`. One causal attention layer "
             f"(batch {BATCH}, {HEADS} heads, {GROUPS} groups, head dim {DIM}), forward + "
             f"backward, median of {args.repeats} after one warm-up; step = slowest rank.", "",
             f"### Sequence {args.seq}", "",
             "| cp | comm | step (s) | tokens/s | activations saved per rank (MiB) | "
             "vs cp 1 / cp | peak allocated per rank (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["saved_mib"] / (base["saved_mib"] / r["cp"])
        lines.append(f"| {r['cp']} | {r['comm']} | {r['step_s']:.3f} | {r['tokens_s']:,.0f} | "
                     f"{r['saved_mib']:.2f} | {ratio:.2f}x | "
                     f"{r['peak_mib']:.1f} |" if args.cuda else
                     f"| {r['cp']} | {r['comm']} | {r['step_s']:.3f} | {r['tokens_s']:,.0f} | "
                     f"{r['saved_mib']:.2f} | {ratio:.2f}x | n/a (CPU) |")
    o = overlap
    lines += ["", f"### p2p overlap (cp {o['cp']}, sequence {args.seq})", "",
              "| ring step (s) | compute alone (s) | communication alone (s) | sum (s) | "
              "ring / sum |", "|---|---|---|---|---|",
              f"| {o['ring']:.3f} | {o['compute']:.3f} | {o['comm']:.3f} | "
              f"{o['compute'] + o['comm']:.3f} | {o['ring'] / (o['compute'] + o['comm']):.2f} |",
              "", f"### Longest sequence within {args.cap_mib} MiB of attention activations per "
              f"rank (p2p, doubling from 1024, up to {args.max_seq})", "",
              "| cp | longest sequence |", "|---|---|"]
    lines += [f"| {cp} | {seq} |" for cp, seq in longest.items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap-mib", type=int, default=16)
    parser.add_argument("--max-seq", type=int, default=16384)
    parser.add_argument("--cuda", action="store_true", help="NCCL on 4 GPUs")
    parser.add_argument("--write", action="store_true", help="append to RESULTS.md")
    args = parser.parse_args()
    text = report(args, *run(args))
    print(text)
    if args.write:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
