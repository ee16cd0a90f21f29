"""plugtron's training step against a plain PyTorch loop: same GPT, data and threads.

Usage: python benchmarks/bench_foundation.py [--iters 30] [--threads 2] [--write]

Both sides train the default GPT sizes on the same standard-library text batches, fp32 and bf16
(bf16 parameters with fp32 main parameters on both sides). Reports tokens/s, their ratio, and
model FLOP utilisation against the measured fp32 matmul peak of this machine.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
import torch.nn.functional as F
from plugtron.core.config import TrainConfig, apply_values
from plugtron.core.distributed import single_process
from plugtron.core.metrics import MetricsLogger
from plugtron.core.training import data_iterators, setup, train_step

SIZES = {"progress": False, "log-interval": 0, "eval-interval": 0, "hidden-dropout": 0.0,
         "attention-dropout": 0.0}


# --------------------------------------------------------------------------- the plain loop


class Block(torch.nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, ffn), torch.nn.Linear(ffn, h)
        self.heads = heads

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(torch.nn.Module):
    def __init__(self, vocab, h, heads, layers, seq):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, h), torch.nn.Embedding(seq, h)
        self.blocks = torch.nn.ModuleList(Block(h, heads, 4 * h) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(h)

    def forward(self, tokens, positions, labels):
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def plain_stepper(config, dtype):
    """One optimizer step of the plain loop per call."""
    m, t = config.model, config.training
    torch.manual_seed(0)
    model = PlainGPT(m.padded_vocab_size, m.hidden_size, m.num_attention_heads, m.num_layers,
                     m.seq_length).to(dtype)
    params = list(model.parameters())
    main = [p.detach().float().clone().requires_grad_() for p in params] if dtype != \
        torch.float32 else params
    opt = torch.optim.AdamW(main, lr=t.lr, foreach=True)

    def step(microbatches):
        for p in params:
            p.grad = None
        for mb in microbatches:
            loss = model(mb["tokens"], mb["position_ids"], mb["labels"]) / len(microbatches)
            loss.backward()
        if main is not params:
            for p, q in zip(params, main):
                q.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(main, t.clip_grad)
        opt.step()
        if main is not params:
            with torch.no_grad():
                for p, q in zip(params, main):
                    p.copy_(q)

    return step


# --------------------------------------------------------------------------- plugtron


def compare(config, iters, dtype):
    """Time plugtron's and the plain loop's steps alternately on the same batches, so that
    whatever else the machine does weighs on both alike; returns per-step times."""
    run = setup(config, world=single_process())
    MetricsLogger(config, rank=1)
    ours_iter = data_iterators(run, run.datasets[0], 0)
    batches_iter = data_iterators(run, run.datasets[0], 0)[0]
    plain = plain_stepper(config, dtype)
    ours, theirs = [], []
    for iteration in range(1, iters + 1):
        batch = [next(batches_iter) for _ in range(run.num_microbatches)]
        run.scheduler.prepare(iteration)
        start = time.perf_counter()
        train_step(run, ours_iter)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        plain(batch)
        theirs.append(time.perf_counter() - start)
    return run, ours, theirs


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def matmul_peak(threads: int, dtype=torch.float32) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    for _ in range(3):
        a @ b
    start, n = time.perf_counter(), 10
    for _ in range(n):
        a @ b
    return 2 * 2048 ** 3 * n / (time.perf_counter() - start)


def flops_per_token(config, num_params):
    m = config.model
    return 6 * num_params + 12 * m.num_layers * m.hidden_size * m.seq_length


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = {"fp32": matmul_peak(args.threads), "bf16": matmul_peak(args.threads, torch.bfloat16)}
    rows = []
    for precision in ("fp32", "bf16"):
        config = TrainConfig()
        apply_values(config, {**SIZES, "bf16": precision == "bf16",
                              "train-iters": args.iters + args.warmup}, "bench")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        run, ours, theirs = compare(config, args.iters + args.warmup, dtype)
        tokens = config.training.global_batch_size * config.model.seq_length
        ours_tps = tokens / median(ours[args.warmup:])
        theirs_tps = tokens / median(theirs[args.warmup:])
        num_params = sum(p.numel() for c in run.model_chunks for p in c.parameters())
        mfu = ours_tps * flops_per_token(config, num_params) / peaks[precision]
        rows.append((precision, ours_tps, theirs_tps, ours_tps / theirs_tps, mfu))
    lines = [f"| {p} | {a:,.0f} | {b:,.0f} | {r:.3f} | {m * 100:.1f}% |"
             for p, a, b, r, m in rows]
    table = "\n".join(["| precision | plugtron tokens/s | plain loop tokens/s | ratio | plugtron MFU |",
                       "|---|---|---|---|---|", *lines])
    report = (f"## Foundation: plugtron vs a plain PyTorch loop ({datetime.date.today()})\n\n"
              f"Machine: {platform.machine()} CPU, {args.threads} threads, torch "
              f"{torch.__version__}. Command: `python benchmarks/bench_foundation.py "
              f"--iters {args.iters} --threads {args.threads} --write`. Default GPT (4 layers, "
              f"hidden 128, seq 128, global batch 32 as 4 microbatches of 8), stdlib text, "
              f"median of {args.iters} steps after {args.warmup} warm-up, the two sides "
              f"alternating step by step. MFU is against the "
              f"measured 2048x2048 matmul peak of the same precision: fp32 "
              f"{peaks['fp32'] / 1e9:.1f}, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s.\n\n{table}\n")
    print(report)
    if args.write:
        with open("benchmarks/RESULTS.md", "a") as f:
            f.write("\n" + report)


if __name__ == "__main__":
    main()
