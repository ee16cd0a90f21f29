"""The Hybrid model's speed: plugtron's Mamba-2 layer against transformers', hybrid against GPT,
and how the step time grows with the sequence.

Usage: python benchmarks/bench_hybrid.py [--threads 2] [--repeats 3] [--sections layer,models,scaling]
[--write]

1. One Mamba-2 layer (pre-norm, mixer, residual), forward + backward, tokens/s: plugtron's
   ``M`` layer against transformers' ``Mamba2Block`` on its pure-torch path (no CUDA kernels),
   same sizes and chunk, fp32, at sequence 512, 1024 and 2048; the two alternate round by
   round; the ratio is the median of the per-round ratios over ``--repeats`` rounds.
2. A hybrid model ``M*-M-M*-M-`` against a GPT model of about the same parameter count at
   sequence 2048: training-step tokens/s (forward + backward) and peak memory (each model in a
   fresh process; peak resident memory above the process's baseline).
3. Step time against sequence length for a Mamba-only and an attention-only stack (same
   hidden size): linear for ``M``, quadratic for ``*``; a table and benchmarks/hybrid_scaling.png.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time

import torch
from results import write_section

SIZES = {"hidden-size": 256, "mamba-state-dim": 64, "mamba-head-dim": 64, "mamba-num-groups": 2,
         "mamba-chunk-size": 128, "num-attention-heads": 4, "vocab-size": 1024,
         "make-vocab-size-divisible-by": 128, "normalization": "RMSNorm",
         "hidden-dropout": 0.0, "attention-dropout": 0.0}
HERE = os.path.dirname(os.path.abspath(__file__))


def build(flags: dict, seq: int):
    """A one-process plugtron model of ``flags`` (tp 1), its config."""
    from plugtron.api import ParallelContext
    from plugtron.core.plugins import registry
    from plugtron.core.training.loop import finalize_model_config
    from plugtron.testing import make_config

    sizes = {k: v for k, v in SIZES.items()
             if flags.get("model") == "hybrid" or not k.startswith("mamba-")}
    config = make_config({**sizes, "seq-length": seq, **flags})
    parallel = ParallelContext.build(1, 0)
    finalize_model_config(config, parallel)
    backend = registry.load("layer_backend", "local")(config, parallel)
    plugin = registry.instantiate(registry.load("model", config.plugins.model))
    model = plugin.model_provider(config=config, pre_process=True, post_process=True,
                                  vp_stage=None, layer_backend=backend, parallel=parallel)
    return model, config


def timed(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up (a median, not the best: on a
    shared machine the best is a lucky round, the median what a user sees)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --------------------------------------------------------------------------- 1. one layer


def layer_pair(seq: int):
    """plugtron's M layer and transformers' Mamba2Block with the same sizes (fp32)."""
    import transformers
    from plugtron_gpt.hybrid.mamba import MambaLayer

    model, config = build({"model": "hybrid", "hybrid-layer-pattern": "M", "num-layers": 1},
                          seq)
    ours = model.decoder.layers["0"]
    h, o = config.model.hidden_size, config.hybrid
    hf_config = transformers.Mamba2Config(
        hidden_size=h, num_heads=2 * h // o.head_dim, head_dim=o.head_dim,
        state_size=o.state_dim, n_groups=o.num_groups, chunk_size=o.chunk_size,
        num_hidden_layers=1, vocab_size=8, residual_in_fp32=False)
    theirs = transformers.models.mamba2.modeling_mamba2.Mamba2Block(hf_config, layer_idx=0)
    assert isinstance(ours.parts[0], MambaLayer)
    return ours, theirs


def fwd_bwd(layer, x):
    def step():
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    return step


def bench_layer(seqs, repeats: int, batch: int = 1) -> list[dict]:
    """Per sequence: tokens/s of both sides and their ratio, in torch's default floating-point
    mode; ``flushed``: the ratio again with denormal numbers flushed to zero (FTZ/DAZ) for both.
    The decays of a chunked scan are exponentials of long negative sums, so both sides meet
    denormals, and the CPU's microcode handles each one slowly: transformers' scan more than
    plugtron's (its step took 1.5-2.5x longer with them than without on this machine)."""
    rows = []
    for seq in seqs:
        row = _layer_row(seq, repeats, batch)
        torch.set_flush_denormal(True)
        try:
            row["flushed"] = _layer_row(seq, repeats, batch)["ratio"]
        finally:
            torch.set_flush_denormal(False)  # torch's default
        rows.append(row)
        print(f"layer seq {seq}: plugtron {row['plugtron']:.0f} tok/s, transformers "
              f"{row['transformers']:.0f} tok/s, ratio {row['ratio']:.2f}, with denormals "
              f"flushed {row['flushed']:.2f}", flush=True)
    return rows


def _layer_row(seq: int, repeats: int, batch: int) -> dict:
    torch.manual_seed(0)  # the same weights and input in both modes and every run
    ours, theirs = layer_pair(seq)
    x = torch.randn(batch, seq, ours.parts[0].norm.weight.shape[0], requires_grad=True)
    times = {"plugtron": [], "transformers": []}
    fwd_bwd(ours, x)(), fwd_bwd(theirs, x)()  # warm-up
    for _ in range(repeats):  # alternate, so drifts of a shared machine hit both
        times["plugtron"].append(timed_once(fwd_bwd(ours, x)))
        times["transformers"].append(timed_once(fwd_bwd(theirs, x)))
    # Per-round ratios (same moment of the machine for both), then their median.
    ratio = statistics.median(t / o for o, t in zip(times["plugtron"],
                                                    times["transformers"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = batch * seq
    return {"seq": seq, "plugtron": tokens / med["plugtron"],
            "transformers": tokens / med["transformers"], "ratio": ratio}


# --------------------------------------------------------------------------- 2. hybrid vs GPT


def param_count(flags: dict) -> int:
    model, _ = build(flags, 64)
    return sum(p.numel() for p in model.parameters())


def _train_step_child(flags: dict, seq: int, repeats: int, threads: int, queue) -> None:
    """Runs in a fresh (spawned) process, so its peak memory is this model's alone."""
    torch.set_num_threads(threads)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, config = build(flags, seq)
    tokens = torch.randint(0, config.model.vocab_size, (1, seq))

    def step():
        model(tokens, labels=tokens).sum().backward()
        model.zero_grad(set_to_none=True)

    seconds = timed(step, repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline  # KiB on Linux
    queue.put((seq / seconds, peak / 1024, seconds))


def in_fresh_process(flags: dict, seq: int, repeats: int, threads: int):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_train_step_child, args=(flags, seq, repeats, threads, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def bench_models(seq: int, repeats: int, threads: int) -> dict:
    hybrid = {"model": "hybrid", "hybrid-layer-pattern": "M*-M-M*-M-", "num-layers": 10}
    hybrid_params = param_count(hybrid)
    # The GPT depth whose parameter count is closest to the hybrid's.
    gpt_layers = min(range(1, 13), key=lambda n: abs(
        param_count({"model": "gpt", "num-layers": n, "position-embedding-type": "rope"})
        - hybrid_params))
    gpt = {"model": "gpt", "num-layers": gpt_layers, "position-embedding-type": "rope"}
    out = {}
    for name, flags in (("hybrid M*-M-M*-M-", hybrid), (f"gpt {gpt_layers} layers", gpt)):
        tps, peak, seconds = in_fresh_process(flags, seq, repeats, threads)
        out[name] = {"params": param_count(flags), "tokens_s": tps, "peak_mib": peak,
                     "step_s": seconds}
        print(f"{name}: {out[name]['params']:,} params, {tps:.0f} tok/s, peak {peak:.0f} MiB",
              flush=True)
    return out


# --------------------------------------------------------------------------- 3. scaling


def bench_scaling(seqs, repeats: int) -> list[dict]:
    rows = []
    for seq in seqs:
        row = {"seq": seq}
        for name, pattern in (("M", "MMMM"), ("*", "****")):
            model, config = build({"model": "hybrid", "hybrid-layer-pattern": pattern,
                                   "num-layers": 4}, seq)
            tokens = torch.randint(0, config.model.vocab_size, (1, seq))

            def step():
                model(tokens, labels=tokens).sum().backward()
                model.zero_grad(set_to_none=True)

            row[name] = timed(step, repeats)
        rows.append(row)
        print(f"scaling seq {seq}: M {row['M']:.3f} s, * {row['*']:.3f} s", flush=True)
    return rows


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    seqs = [r["seq"] for r in rows]
    plt.figure(figsize=(5, 3.5))
    plt.plot(seqs, [r["M"] for r in rows], "o-", label="4 x M (Mamba-2)")
    plt.plot(seqs, [r["*"] for r in rows], "s-", label="4 x * (attention)")
    plt.xlabel("sequence length")
    plt.ylabel("fwd+bwd step time (s)")
    plt.xscale("log", base=2)
    plt.yscale("log")
    plt.legend()
    plt.title("plugtron hybrid: step time vs sequence")
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    return True


def report(args, layer_rows, models, scaling_rows, plotted) -> str:
    # The heading names what was measured: a partial run replaces only its own section.
    parts = [name for key, name in (("layer", "Mamba-2 layer"), ("models", "hybrid vs GPT"),
                                    ("scaling", "sequence scaling"))
             if key in args.sections.split(",")]
    lines = [f"\n## Hybrid model: {', '.join(parts)} ({datetime.date.today().isoformat()})\n",
             f"Machine: {platform.machine()} CPU, {args.threads} threads, torch "
             f"{torch.__version__}. Command: "
             f"`{' '.join(['python benchmarks/bench_hybrid.py', *sys.argv[1:]])}`. "
             f"fp32, batch 1, hidden "
             f"{SIZES['hidden-size']}, Mamba head dim {SIZES['mamba-head-dim']} (8 heads), "
             f"state {SIZES['mamba-state-dim']}, {SIZES['mamba-num-groups']} groups, chunk "
             f"{SIZES['mamba-chunk-size']}; medians of {args.repeats} rounds, the two sides "
             f"alternating (layer ratio: median of per-round ratios). Load average at the "
             f"start: {os.getloadavg()[0]:.1f} (a machine shared by other work: noisy).\n",
             "| seq | plugtron M layer tokens/s | transformers Mamba2Block tokens/s | ratio | "
             "ratio, denormals flushed |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['seq']} | {r['plugtron']:,.0f} | {r['transformers']:,.0f} | "
              f"{r['ratio']:.2f} | {r['flushed']:.2f} |" for r in layer_rows]
    if layer_rows:
        lines += ["", "Ratio: torch's default floating-point mode, what a user runs. Flushed: "
                  "both sides again with `torch.set_flush_denormal(True)` (denormal numbers "
                  "read and written as zero), which takes away the CPU's slow handling of the "
                  "denormals the scans' decays produce (exponentials of long negative sums); "
                  "transformers' scan meets more of them. The layers' weights and input are "
                  "seeded, the same in both modes."]
    if models:
        lines += ["", "| model (seq 2048) | parameters | tokens/s | peak memory (MiB) |",
                  "|---|---|---|---|"]
        lines += [f"| {name} | {m['params']:,} | {m['tokens_s']:,.0f} | {m['peak_mib']:,.0f} |"
                  for name, m in models.items()]
    if scaling_rows:
        lines += ["", "| seq | 4 x M step (s) | 4 x * step (s) |", "|---|---|---|"]
        lines += [f"| {r['seq']} | {r['M']:.3f} | {r['*']:.3f} |" for r in scaling_rows]
    if plotted:
        lines += ["", "Plot: benchmarks/hybrid_scaling.png."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layer-seqs", default="512,1024,2048")
    parser.add_argument("--scaling-seqs", default="256,512,1024,2048,4096")
    parser.add_argument("--sections", default="layer,models,scaling",
                        help="which parts to run (comma-separated): layer, models, scaling")
    parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sections = set(args.sections.split(","))
    unknown = sections - {"layer", "models", "scaling"}
    if unknown:
        parser.error(f"unknown --sections {sorted(unknown)}; allowed: layer, models, scaling")
    layer_rows = (bench_layer([int(s) for s in args.layer_seqs.split(",")], args.repeats)
                  if "layer" in sections else [])
    models = bench_models(2048, args.repeats, args.threads) if "models" in sections else {}
    scaling_rows = (bench_scaling([int(s) for s in args.scaling_seqs.split(",")], args.repeats)
                    if "scaling" in sections else [])
    plotted = scaling_rows and plot(scaling_rows, os.path.join(HERE, "hybrid_scaling.png"))
    text = report(args, layer_rows, models, scaling_rows, plotted)
    print(text)
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
