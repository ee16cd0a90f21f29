"""Attention over packed documents against plain causal attention at the same length (the local
backend's CoreAttention, forward + backward, CPU, one thread), side by side in one run: the
documents' attention does less work (the sum of their squares), so it should cost no more.

Usage: python benchmarks/bench_document_attention.py [--rounds 7] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time

import torch
from results import write_section

SEQ, HEADS, DIM = 2048, 8, 64
CASES = {"8 documents of 256": [256] * 8, "2 documents of 1024": [1024] * 2,
         "uneven (1000, 700, 300, 48)": [1000, 700, 300, 48],
         "128 documents of 16": [16] * 128}


def _step(attention, q, k, v, grad, documents):
    from plugtron.api import forward_context

    start = time.perf_counter()
    with (forward_context(document_ids=documents) if documents is not None
          else contextlib.nullcontext()):
        attention(q, k, v).backward(grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from plugtron.plugins.layer_backends.local import CoreAttention

    attention = CoreAttention(HEADS, HEADS, DIM, 0.0, contextlib.nullcontext)
    q, k, v = (torch.randn(1, SEQ, HEADS, DIM, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, SEQ, HEADS * DIM)
    variants = {"causal (no documents)": None}
    for name, lengths in CASES.items():
        variants[name] = torch.repeat_interleave(torch.arange(len(lengths)),
                                                 torch.tensor(lengths))[None]
    for documents in variants.values():  # warm-up
        _step(attention, q, k, v, grad, documents)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, documents in variants.items():
            times[name].append(_step(attention, q, k, v, grad, documents))
    base = times["causal (no documents)"]
    lines = [f"\n## Packed documents' attention against causal attention ({time.strftime('%Y-%m-%d')})\n",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, one thread, fp32. Command: `python "
             f"benchmarks/bench_document_attention.py --rounds {args.rounds}`. The local "
             f"backend's attention over {SEQ} tokens, {HEADS} heads of {DIM}, forward and "
             f"backward; variants alternate in each round; median ms and median per-round "
             f"ratio to causal attention of the whole sequence:\n",
             "| documents | ms | / causal |", "|---|---|---|"]
    for name, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, base))
        lines.append(f"| {name} | {statistics.median(t) * 1e3:.1f} | {ratio:.2f} |")
    lines.append("\nfp32 without attention dropout, documents of 64 tokens or more on average: "
                 "each document's flash attention alone, in one autograd function that keeps "
                 "what causal flash keeps (plugins/layer_backends/document_attention.py); "
                 "shorter documents (and bf16, dropout) take one masked kernel over the "
                 "sequence. Ratios, not times: the machine may be shared.\n")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
