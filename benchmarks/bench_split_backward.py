"""A split backward (``I`` then ``W``) against the combined ``B`` on one pipeline stage: the cost
that decides whether a zero-bubble schedule can beat 1F1B.

One stage = 4 decoder layers of a GPT, an MoE model (8 experts, top 2, grouped experts) and the
Hybrid model (Mamba, attention, MLP), one process, fp32, forward then backward from a fixed
output gradient: ``B`` as a combined backward, ``I`` as the schedule's input-gradient pass (the
layers' weight gradients deferred into a store) and ``W`` as the store's run, both measured.
Every variant alternates within each round; medians over the rounds. Two sizes: the pipeline
benchmark's (hidden 256, micro batch 2 x 128 tokens) and a larger one (hidden 1024, 2 x 512).
The process tunes the C heap as a CPU training rank does (core/blocks/cpu_allocator.py).

Usage: python benchmarks/bench_split_backward.py [--rounds 9] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import torch
from results import write_section

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SIZES = {"small": (256, 128), "large": (1024, 512)}
MODELS = {"GPT": {}, "MoE": {"num_experts": 8, "moe_router_topk": 2, "moe_grouped_gemm": True},
          "Hybrid": {"model": "hybrid", "hybrid_override_pattern": "M*M-"}}


def _stage(model_flags: dict, hidden: int, seq: int):
    from plugtron.core.config import padded_vocab_size
    from plugtron.core.parallel.context import ParallelContext
    from plugtron.core.plugins import registry
    from plugtron.core.plugins.selection import selected_driver

    from tests.utils import tiny_config

    flags = dict(num_layers=4, hidden_size=hidden, num_attention_heads=8, seq_length=seq,
                 micro_batch_size=2, ffn_hidden_size=4 * hidden, hidden_dropout=0.0,
                 attention_dropout=0.0, **model_flags)
    if "num_experts" in model_flags:
        flags["ffn_hidden_size"] = hidden  # 2 of 8 experts of h: the dense GPT's 4h/2
    config = tiny_config(**flags)
    m = config.model
    m.padded_vocab_size = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    parallel = ParallelContext.build(1, 0, create_groups=False)
    backend = registry.load("layer_backend", "local")(config, parallel)
    plugin = registry.instantiate(registry.load("model", selected_driver(config, "model")))
    model = plugin.model_provider(config=config, pre_process=True, post_process=True,
                                  vp_stage=None, layer_backend=backend, parallel=parallel)
    rotary = None
    if getattr(model, "use_rotary", False):
        from plugtron.core.blocks.rotary import rotary_freqs_at

        rotary = rotary_freqs_at(torch.arange(seq).expand(2, -1), model.head_dim,
                                 m.rotary_base, None)
    return list(model.train().decoder.layers.values()), rotary


def _measure(layers, rotary, hidden: int, seq: int, rounds: int) -> dict[str, float]:
    from plugtron.core.contracts import weight_grads as wgrad

    gen = torch.Generator().manual_seed(0)
    h, grad = (torch.randn(2, seq, hidden, generator=gen) for _ in range(2))

    def forward(split: bool):
        x = h.clone().requires_grad_()
        with wgrad.expecting_split_backward() if split else contextlib.nullcontext():
            y = x
            for layer in layers:
                y = layer(y, rotary) if rotary is not None else layer(y)
        return y

    def combined():
        y = forward(False)
        start = time.perf_counter()
        y.backward(grad)
        return time.perf_counter() - start, 0.0

    def split():
        y = forward(True)
        store = wgrad.WeightGradStore()
        start = time.perf_counter()
        with wgrad.collecting_weight_grads(store):
            y.backward(grad)
        mid = time.perf_counter()
        store.run()
        return mid - start, time.perf_counter() - mid

    for run in (combined, split, combined, split):  # warm-up
        run()
    b, i, w = [], [], []
    for _ in range(rounds):
        b.append(combined()[0])
        ti, tw = split()
        i.append(ti)
        w.append(tw)
    ratios = [(ti + tw) / tb for ti, tw, tb in zip(i, w, b)]
    return {"B": statistics.median(b), "I": statistics.median(i), "W": statistics.median(w),
            "ratio": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from plugtron.core.blocks.cpu_allocator import keep_freed_memory

    keep_freed_memory()
    rows = []
    for size, (hidden, seq) in SIZES.items():
        for name, flags in MODELS.items():
            layers, rotary = _stage(flags, hidden, seq)
            r = _measure(layers, rotary, hidden, seq, args.rounds)
            rows.append(f"| {name} | {size} (h {hidden}, 2 x {seq}) | {r['B'] * 1e3:.1f} | "
                        f"{r['I'] * 1e3:.1f} | {r['W'] * 1e3:.1f} | {r['ratio']:.3f} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        f"\n## Split backward: I + W against a combined B on one stage ({time.strftime('%Y-%m-%d')})\n",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, one thread, fp32. Command: `python "
        f"benchmarks/bench_split_backward.py --rounds {args.rounds}`. 4 decoder layers, "
        f"forward then backward from a fixed output gradient; B combined, I the input-gradient "
        f"pass with the weight gradients deferred, W their run; median ms, and the median "
        f"per-round ratio (I + W) / B:\n",
        "| model | size | B ms | I ms | W ms | (I + W) / B |", "|---|---|---|---|---|---|",
        *rows,
        "\nThe goal is 1.05. What bounds the small size is where the weight-gradient matmuls "
        "run, not what they compute: W's matmuls are the combined backward's (the same "
        "operands and shapes), 15-20% slower per call because their operands (each layer's "
        "input and output gradient) have left the cache by the time W runs, where B uses each "
        "gradient right after computing it; at 256 tokens these matmuls are memory-bound. At "
        "1024 tokens they are compute-bound and the ratio comes to about 1.0. Tried: the C "
        "heap kept across steps (page faults in I came from the gradients W holds: 1.28 -> "
        "1.21 on GPT, small), W in reverse order (hotter operands first: within noise, "
        "dropped), the norm's deferred scale gradient by torch's fused kernel (kept), and the "
        "grouped experts' split backward on torch's grouped mm (it took a padded batched mm: MoE "
        "1.13 -> 1.02-1.05 at the large size).\n"])
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
