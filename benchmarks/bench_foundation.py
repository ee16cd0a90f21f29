"""plugtron's training step against a plain PyTorch loop: same GPT, data and threads.

Usage: python benchmarks/bench_foundation.py [--model issue|small] [--rounds 10]
       [--bf16-rounds 3] [--precisions fp32,bf16] [--threads 2] [--write]

Both sides train the same GPT (nn.Linear, F.scaled_dot_product_attention, AdamW, tied
embeddings, clip_grad_norm_ 1.0 on the plain side) on the same batches, fp32 and bf16 (bf16
parameters with fp32 main parameters on both sides). ``--model issue`` is issue 16's model
(GPT-2 layout, 4 layers, hidden 256, 4 heads, seq 256, micro batch 8, vocab 256, dropout 0, mock
data); ``--model small`` the default GPT sizes on stdlib text (the earlier sections of
RESULTS.md). The two sides alternate step by step; the report gives the median tokens/s of each,
the median of the per-round ratios, and MFU against the measured matmul peak of this machine in
the same precision.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import torch
import torch.nn.functional as F
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.training.data import microbatch_iterator
from plugtron.core.training.loop import data_iterators, setup, train_step
from results import write_section

SIZES = {"progress": False, "log-interval": 0, "eval-interval": 0, "hidden-dropout": 0.0,
         "attention-dropout": 0.0}
MODELS = {
    "issue": ({"num-layers": 4, "hidden-size": 256, "num-attention-heads": 4, "seq-length": 256,
               "micro-batch-size": 8, "global-batch-size": 32, "data": "mock",
               "vocab-size": 256},
              "issue 16's GPT (4 layers, hidden 256, 4 heads, seq 256, vocab 256, mock data, "
              "global batch 32 as 4 microbatches of 8)"),
    "small": ({}, "default GPT (4 layers, hidden 128, seq 128, stdlib text, vocab 257 padded "
                  "to 384, global batch 32 as 4 microbatches of 8)"),
}


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


def compare(config, rounds, warmup, dtype, peak=None):
    """Time plugtron's and the plain loop's steps alternately on the same batches, so that
    whatever else the machine does weighs on both alike; returns per-step times after the
    warm-up steps, and plugtron's data time within each of its steps (the plain loop's
    batches are drawn before its clock starts). Which side goes first alternates from round
    to round (the second of a pair runs on a warmer cache and allocator, and the first right
    after the peak sample), and the plain loop's batches are read inline, so no prefetch
    thread of theirs runs inside plugtron's clock. ``peak`` (a :class:`MatmulPeak`) takes a
    sample after every round."""
    run = setup(config, world=single_process())
    MetricsLogger(config, rank=1)
    timers: list = []
    ours_iter = data_iterators(run, run.datasets[0], 0, timers)
    batches_iter = microbatch_iterator(run.datasets[0], config.training.micro_batch_size, 0, 1)
    plain = plain_stepper(config, dtype)
    ours, theirs, data_s = [], [], []

    def ours_step():
        start = time.perf_counter()
        train_step(run, ours_iter)
        ours.append(time.perf_counter() - start)
        data_s.append(sum(timer.take_wait() for timer in timers))

    def plain_step(batch):
        start = time.perf_counter()
        plain(batch)
        theirs.append(time.perf_counter() - start)

    for iteration in range(1, warmup + rounds + 1):
        batch = [next(batches_iter) for _ in range(run.num_microbatches)]
        run.scheduler.prepare(iteration)
        if iteration % 2:
            ours_step()
            plain_step(batch)
        else:
            plain_step(batch)
            ours_step()
        if peak is not None:
            peak.sample()
    return run, ours[warmup:], theirs[warmup:], data_s[warmup:]


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


class MatmulPeak:
    """The machine's matmul FLOP/s in one precision, measured again and again during the run.

    One sample times square matmuls of several sizes (the largest that fits the time budget,
    and the two below it), each a few times, and keeps the best; :meth:`sample` runs between
    the benchmark's rounds, so the peak sees the same machine state as the steps do, and the
    reported peak is the best over every sample (a loaded moment only lowers a sample, never
    raises it). A single 2048x2048 measurement, as before, moved by 40% between runs on a
    shared machine. Each size is timed in two layouts, ``a @ b`` and ``a @ b.t()`` (a linear
    layer's), the faster kept: without native bf16/fp16 instructions (AVX2) only the second runs
    fast in half precision (19 against 1.2 GFLOP/s at 2048 in bf16), and the peak is what the
    machine can do."""

    def __init__(self, threads: int, dtype=torch.float32, budget_s: float = 1.5):
        self.dtype, self.budget_s = dtype, budget_s
        torch.set_num_threads(threads)
        # Native or emulated (bf16 without AVX-512 is ~100x slower than fp32): against fp32
        # at the same moment, so that a loaded machine does not shrink the sizes. Native: up
        # to 2048; emulated: the largest size whose one matmul fits the budget.
        per_flop = self._seconds_per_flop(512, dtype)
        largest = 2048
        if per_flop > 5 * self._seconds_per_flop(512, torch.float32):
            largest = next((n for n in (2048, 1024, 512) if per_flop * 2 * n ** 3 < budget_s),
                           256)
        self.sizes = sorted({max(128, largest // 4), max(128, largest // 2), largest})
        self.samples: list[float] = []
        self.best_size = largest
        self._inputs = {n: (torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype))
                        for n in self.sizes}

    @staticmethod
    def _seconds_per_flop(n: int, dtype) -> float:
        probe = torch.randn(n, n, dtype=dtype)
        probe @ probe.t()
        timings = []
        for _ in range(3):  # the best of three
            start = time.perf_counter()
            probe @ probe.t()
            timings.append(time.perf_counter() - start)
        return min(timings) / (2 * n ** 3)

    def sample(self) -> float:
        best, size = 0.0, self.best_size
        for n in self.sizes:
            a, b = self._inputs[n]
            for right in (b.t(), b):
                if right is b and self.dtype != torch.float32 and n > 512:
                    continue  # the slow half-precision layout: seconds per matmul, never best
                a @ right  # warm: the first call of a size pays its allocation
                for _ in range(2):
                    start = time.perf_counter()
                    a @ right
                    rate = 2 * n ** 3 / (time.perf_counter() - start)
                    if rate > best:
                        best, size = rate, n
        self.samples.append(best)
        if best >= max(self.samples):
            self.best_size = size
        return best

    @property
    def peak(self) -> float:
        return max(self.samples)

    def describe(self) -> str:
        return (f"{self.peak / 1e9:.1f} GFLOP/s (best of {len(self.samples)} samples over "
                f"{'/'.join(map(str, self.sizes))}, at {self.best_size}; median sample "
                f"{median(self.samples) / 1e9:.1f})")


def cpu_name() -> str:
    """platform.processor(), or the model name Linux reports where that is empty."""
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = name or next((line.split(":", 1)[1].strip() for line in f
                                 if line.startswith("model name")), "")
    except OSError:
        pass
    return name or "unknown"


def flops_per_token(config, num_params):
    m = config.model
    return 6 * num_params + 12 * m.num_layers * m.hidden_size * m.seq_length


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="issue")
    parser.add_argument("--rounds", type=int, default=10, help="timed fp32 rounds")
    parser.add_argument("--bf16-rounds", type=int, default=None,
                        help="timed bf16 rounds (default: --rounds)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    sizes, description = MODELS[args.model]
    rows, peaks = [], {}
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        peaks[precision] = MatmulPeak(args.threads, dtype)
        peaks[precision].sample()
        rounds = args.rounds if precision == "fp32" or args.bf16_rounds is None \
            else args.bf16_rounds
        config = config_from_flags({**SIZES, **sizes, "bf16": precision == "bf16",
                              "train-iters": rounds + args.warmup}, "bench")
        run, ours, theirs, data_s = compare(config, rounds, args.warmup, dtype,
                                            peaks[precision])
        tokens = config.training.global_batch_size * config.model.seq_length
        ours_tps, theirs_tps = tokens / median(ours), tokens / median(theirs)
        ratios = [b / a for a, b in zip(ours, theirs)]
        num_params = sum(p.numel() for c in run.model_chunks for p in c.parameters())
        mfu = ours_tps * flops_per_token(config, num_params) / peaks[precision].peak
        # The same ratio without plugtron's data loading (the plain side's is outside its clock).
        compute = median([b / (a - d) for a, b, d in zip(ours, theirs, data_s)])
        rows.append((precision, rounds, ours_tps, theirs_tps, median(ratios), min(ratios),
                     max(ratios), median(data_s) * 1e3, compute, mfu))
        print(rows[-1], flush=True)
    lines = [f"| {p} | {n} | {a:,.0f} | {b:,.0f} | {r:.3f} | {lo:.3f}-{hi:.3f} | {d:.1f} | "
             f"{c:.3f} | {m * 100:.1f}% |" for p, n, a, b, r, lo, hi, d, c, m in rows]
    table = "\n".join(["| precision | rounds | plugtron tokens/s | plain loop tokens/s | "
                       "median ratio | ratio range | plugtron data ms/step | "
                       "ratio without data time | plugtron MFU |",
                       "|---|---|---|---|---|---|---|---|---|", *lines])
    peak_text = ", ".join(f"{p} {v.describe()}" for p, v in peaks.items())
    command = " ".join(["python benchmarks/bench_foundation.py", *sys.argv[1:]])
    report = (f"## Foundation: plugtron vs a plain PyTorch loop, {args.model} model "
              f"({datetime.date.today()})\n\n"
              f"Machine: {platform.machine()} CPU ({cpu_name()}, torch "
              f"CPU capability {torch.backends.cpu.get_cpu_capability()}), {args.threads} "
              f"threads, torch {torch.__version__}. Command: `{command}`. {description}; "
              f"{args.warmup} warm-up steps, then the two sides alternating step by step; the "
              f"ratio is plugtron's tokens/s over the plain loop's, per round. MFU is against "
              f"the measured matmul peak of the same precision (square matmuls of three sizes, "
              f"sampled before the rounds and after each, the best kept): {peak_text}.\n\n{table}\n")
    print(report)
    if args.write:
        write_section(report)


if __name__ == "__main__":
    main()
