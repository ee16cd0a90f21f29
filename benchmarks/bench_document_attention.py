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


def _measure(attention, dtype, rounds: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, SEQ, HEADS, DIM, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, SEQ, HEADS * DIM, dtype=dtype)
    variants = {"causal (no documents)": None}
    for name, lengths in CASES.items():
        variants[name] = torch.repeat_interleave(torch.arange(len(lengths)),
                                                 torch.tensor(lengths))[None]
    for documents in variants.values():  # warm-up
        _step(attention, q, k, v, grad, documents)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, documents in variants.items():
            times[name].append(_step(attention, q, k, v, grad, documents))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from plugtron.api import cpu_matrix_support
    from plugtron.plugins.layer_backends.local import CoreAttention

    attention = CoreAttention(HEADS, HEADS, DIM, 0.0, contextlib.nullcontext)
    dropout = CoreAttention(HEADS, HEADS, DIM, 0.1, contextlib.nullcontext).train()
    results = {name: _measure(module, dtype, args.rounds) for name, module, dtype in (
        ("fp32", attention, torch.float32), ("bf16", attention, torch.bfloat16),
        ("fp32, attention dropout 0.1", dropout, torch.float32))}
    lines = [f"\n## Packed documents' attention against causal attention ({time.strftime('%Y-%m-%d')})\n",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
             f"(bf16 matrix support: {cpu_matrix_support(torch.bfloat16)}), "
             f"torch {torch.__version__}, one thread. Command: `python "
             f"benchmarks/bench_document_attention.py --rounds {args.rounds}`. The local "
             f"backend's attention over {SEQ} tokens, {HEADS} heads of {DIM}, forward and "
             f"backward; variants alternate in each round; median ms and median per-round "
             f"ratio to causal attention of the whole sequence in the same dtype:\n",
             "| documents | " + " | ".join(f"{kind} ms | / causal" for kind in results) + " |",
             "|---|" + "---|---|" * len(results)]
    for name in results["fp32"]:
        cells = []
        for dtype in results:
            t, base = results[dtype][name], results[dtype]["causal (no documents)"]
            ratio = statistics.median(a / b for a, b in zip(t, base))
            cells += [f"{statistics.median(t) * 1e3:.1f}", f"{ratio:.2f}"]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines.append("\nWithout attention dropout every document runs its own causal flash attention "
                 "(plugins/layer_backends/document_attention.py): one of 128 tokens or more on "
                 "views of its tokens, shorter ones batched by length into zero-padded blocks, "
                 "all in one autograd function that keeps what causal flash keeps; bf16 runs "
                 "natively with AMX, through fp32 copies without. With attention dropout the "
                 "same padded batches, every document's, run through torch's attention with "
                 "dropout under autograd. Ratios, not times: the machine may be shared.\n")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
