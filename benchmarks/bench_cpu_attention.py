"""Causal bf16 attention, forward and backward, on CPU: torch's flash kernel against the local
backend's matmul backward (plugins/layer_backends/cpu_attention.py), side by side, alternating
blocks of steps; and each one's gradient error against the fp64 computation.

    python benchmarks/bench_cpu_attention.py [--rounds 5] [--write]

q, k and v are strided views of one ``[b, s, groups, heads / groups + 2, d]`` tensor, as the
model's attention makes them, and the sizes keep ``b x s`` at 2048 tokens and ``heads x d`` at
256 (the issue model's microbatch); the last rows have grouped queries
(``--num-query-groups``) and packed documents (``--reset-attention-mask``, three documents
per sample: a boolean mask within the causal one). Where the CPU has
no AMX for bf16 the matmuls are emulated: the numbers hold, the timings do not apply.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from bench_foundation import cpu_name
from plugtron.api import cpu_matrix_support
from plugtron.plugins.layer_backends import cpu_attention
from plugtron.plugins.layer_backends.attention_mask import attention_mask
from results import write_section

#: (micro batch, sequence, query heads, key/value groups, packed documents)
SIZES = [(8, 256, 4, 4, False), (4, 512, 4, 4, False), (2, 1024, 4, 4, False),
         (1, 2048, 4, 4, False), (8, 256, 4, 2, False), (8, 256, 4, 4, True)]
HEAD_DIM = 64


def _attentions(mask):
    """flash (SDPA) and the matmul backward, causal or with ``mask``."""
    def flash(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def ours(q, k, v):
        return cpu_attention.causal_attention(q, k, v, mask=mask)

    return flash, ours


def _document_mask(b, s):
    """Three documents per sample, their boundaries differing between samples."""
    documents = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        documents[i, s // 3 + 7 * i:] = 1
        documents[i, 2 * s // 3 + 5 * i:] = 2
    return attention_mask(s, s, document_ids=documents)


def _views(qkv):
    """``[b, heads, s, d]`` q and ``[b, groups, s, d]`` k, v of the packed projection."""
    b, s, groups, per_group, d = qkv.shape
    q, k, v = qkv.split([per_group - 2, 1, 1], dim=3)
    q = q.reshape(b, s, groups * (per_group - 2), d)
    return [t.transpose(1, 2) for t in (q, k.squeeze(3), v.squeeze(3))]


def _step_ms(attention, qkv, grad, steps):
    start = time.perf_counter()
    for _ in range(steps):
        attention(*_views(qkv)).backward(grad)
        qkv.grad = None
    return (time.perf_counter() - start) / steps * 1e3


def _gradient_error(attention, qkv, grad, truth):
    x = qkv.detach().requires_grad_()
    attention(*_views(x)).backward(grad)
    return ((x.grad.double() - truth).norm() / truth.norm()).item()


def measure(b, s, heads, groups, documents, rounds, steps):
    flash, ours = _attentions(_document_mask(b, s) if documents else None)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, s, groups, heads // groups + 2, HEAD_DIM,
                      generator=gen).to(torch.bfloat16)
    grad = torch.randn(b, heads, s, HEAD_DIM, generator=gen).to(torch.bfloat16)
    exact = qkv.double().requires_grad_()
    flash(*_views(exact)).backward(grad.double())
    errors = [_gradient_error(f, qkv, grad, exact.grad) for f in (flash, ours)]
    qkv.requires_grad_()
    for f in (flash, ours):
        _step_ms(f, qkv, grad, 2)
    times = [[], []]
    for _ in range(rounds):
        for i, f in enumerate((flash, ours)):
            times[i].append(_step_ms(f, qkv, grad, steps))
    return [statistics.median(t) for t in times], errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for b, s, heads, groups, documents in SIZES:
        (flash_ms, ours_ms), (flash_err, ours_err) = measure(b, s, heads, groups, documents,
                                                             args.rounds, args.steps)
        used = "yes" if s <= cpu_attention.MAX_SEQ_LENGTH else "no (flash)"
        kv = f", k, v [{b}, {groups}, {s}, {HEAD_DIM}]" if groups != heads else ""
        kv += ", packed documents" if documents else ""
        rows.append(f"| [{b}, {heads}, {s}, {HEAD_DIM}]{kv} | {flash_ms:.2f} | {ours_ms:.2f} | "
                    f"{flash_ms / ours_ms:.2f}x | {flash_err:.2e} | {ours_err:.2e} | {used} |")
    table = "\n".join([
        "| q, k, v | flash ms | matmul backward ms | speed-up | flash grad error | "
        "matmul backward grad error | taken in training |",
        "|---|---|---|---|---|---|---|", *rows])
    print(table)
    if args.write:
        header = (f"\n## Attention backward in bf16 with AMX ({datetime.date.today()})\n\n"
                  f"Machine: {platform.machine()} CPU ({cpu_name()}), torch CPU capability "
                  f"{torch.backends.cpu.get_cpu_capability()}, bf16 matmuls "
                  f"{cpu_matrix_support(torch.bfloat16)}, {args.threads} threads, torch "
                  f"{torch.__version__}. Command: `python benchmarks/bench_cpu_attention.py "
                  f"--rounds {args.rounds} --steps {args.steps} --write`. Causal attention "
                  "forward and backward per call (median of the alternating blocks); gradient "
                  "error: relative Frobenius error of the q, k, v gradients against fp64.\n\n")
        write_section(header + table)


if __name__ == "__main__":
    main()
