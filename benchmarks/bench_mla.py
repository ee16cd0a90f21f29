"""Multi-latent attention (issue 27): plugtron's MLA layer against transformers'
DeepseekV3Attention, forward + backward tokens/s at seq 1024 and 4096; and `plugtron estimate`
against the measured peak of a DeepSeek-V3-shaped model (MLA, dense layers then MoE, MTP).

    .venv/bin/python benchmarks/bench_mla.py            # writes its section of RESULTS.md
    .venv/bin/python benchmarks/bench_mla.py --no-write --rounds 2

1. The same weights in both layers (fp32, batch 1, both threads of the machine); transformers
   runs its SDPA path (its fastest on a CPU). The two alternate round by round; each round
   times ``--reps`` forward + backward passes of each; the ratio is the median over rounds.
   Outputs are checked equal first (1e-4).
2. One process trains the model three iterations; the last under torch.profiler: the peak of
   live tensor bytes over those alive at its start (parameters, gradient buffers, optimizer
   state), against the estimate's total for the rank.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import statistics
import sys
import time

import torch
from probes import live_peak_bytes
from results import write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

HIDDEN, HEADS, Q_RANK, KV_RANK, QK, POS, V = 512, 8, 384, 128, 64, 32, 64
LAYER = {"num-layers": 1, "hidden-size": HIDDEN, "num-attention-heads": HEADS,
         "multi-latent-attention": True, "q-lora-rank": Q_RANK, "kv-lora-rank": KV_RANK,
         "qk-head-dim": QK, "qk-pos-emb-head-dim": POS, "v-head-dim": V,
         "position-embedding-type": "rope", "normalization": "RMSNorm",
         "add-bias-linear": False, "norm-epsilon": 1e-6, "rotary-base": 10000,
         "attention-dropout": 0.0, "hidden-dropout": 0.0}
NAMES = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj",
         "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj",
         "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
         "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
#: A DeepSeek-V3 shape in miniature: MLA, one dense layer then MoE (sigmoid routing, a shared
#: expert), one MTP layer.
MODEL = {**LAYER, "num-layers": 4, "hidden-size": 256, "num-attention-heads": 4,
         "q-lora-rank": 128, "kv-lora-rank": 64, "qk-head-dim": 32, "qk-pos-emb-head-dim": 16,
         "v-head-dim": 32, "ffn-hidden-size": 512, "swiglu": True, "num-experts": 8,
         "moe-router-topk": 2, "moe-ffn-hidden-size": 128, "moe-layer-freq": "[0]+[1]*3",
         "moe-shared-expert-intermediate-size": 128, "moe-router-score-function": "sigmoid",
         "moe-router-enable-expert-bias": True, "mtp-num-layers": 1, "seq-length": 512,
         "max-position-embeddings": 512, "micro-batch-size": 2, "global-batch-size": 4,
         "vocab-size": 1024, "make-vocab-size-divisible-by": 128, "data": "mock",
         "eval-interval": 0, "progress": False, "log-interval": 0, "lr": 1e-3,
         "min-lr": 1e-4, "lr-warmup-iters": 1}


def _layers(seq: int):
    from plugtron.core.parallel.distributed import single_process
    from plugtron.core.training.loop import setup
    from plugtron.testing import make_config
    from plugtron_gpt.layers.attention_options import rope_scaling
    from plugtron_gpt.layers.rope import rotary_freqs
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    config = make_config({**LAYER, "seq-length": seq, "max-position-embeddings": seq})
    ours = setup(config, world=single_process()).model_chunks[0].module
    ours = ours.decoder.layers["0"].self_attention
    hf_config = DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=Q_RANK, kv_lora_rank=KV_RANK, qk_nope_head_dim=QK, qk_rope_head_dim=POS,
        v_head_dim=V, attention_bias=False, attention_dropout=0.0, rope_interleave=True,
        max_position_embeddings=seq, rope_theta=10000.0)
    hf_config._attn_implementation = "sdpa"
    theirs = deepseek.DeepseekV3Attention(hf_config, layer_idx=0)
    mapped = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            module, leaf = name.rsplit(".", 1)
            mapped[f"{NAMES[module]}.{leaf}"].copy_(p)
    freqs = rotary_freqs(seq, POS, 10000.0, scaling=rope_scaling(config))
    x = torch.randn(1, seq, HIDDEN, generator=torch.Generator().manual_seed(0))
    cos_sin = deepseek.DeepseekV3RotaryEmbedding(hf_config)(x, torch.arange(seq)[None])
    return (lambda t: ours(t, freqs)), (lambda t: theirs(t, cos_sin, None)[0]), x


def _pass(fn, x) -> float:
    x = x.clone().requires_grad_(True)
    start = time.perf_counter()
    out = fn(x)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def layer_speed(seq: int, rounds: int, reps: int) -> dict:
    ours, theirs, x = _layers(seq)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)
    for fn in (ours, theirs):
        _pass(fn, x)  # warm-up
    times: dict = {"plugtron": [], "transformers": []}
    for _ in range(rounds):
        for name, fn in (("plugtron", ours), ("transformers", theirs)):
            times[name].append(statistics.median(_pass(fn, x) for _ in range(reps)))
    ratios = [t / p for p, t in zip(times["plugtron"], times["transformers"])]
    return {"seq": seq, "plugtron": statistics.median(times["plugtron"]),
            "transformers": statistics.median(times["transformers"]),
            "ratio": statistics.median(ratios)}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(field + ":")).split()[1]) * 1024


def _live_peak(rank, world_size, flags: dict) -> dict:
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.tools.estimate import estimate_memory
    from plugtron.core.training.loop import setup, train

    torch.set_num_threads(1)
    config = config_from_flags({**flags, "train-iters": 3}, "benchmark")
    estimate = estimate_memory(config_from_flags({**flags, "train-iters": 3}, "benchmark"),
                               world_size, cuda=False).peak
    before = _status_bytes("VmRSS")
    run = setup(config)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the training's high-water mark, not the build's
    config.training.train_iters = 2
    train(run, MetricsLogger(config, rank=1))
    rss_peak = _status_bytes("VmHWM") - before
    start = (sum(p.numel() * p.element_size() for c in run.model_chunks for p in c.parameters())
             + sum(b.grad_data.numel() * b.grad_data.element_size()
                   for c in run.model_chunks for b in getattr(c, "grad_buffers", ()))
             + run.optimizer.state_bytes())
    config.training.train_iters = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        train(run, MetricsLogger(config, rank=1))
    peak = live_peak_bytes(prof)
    # Live tensors against the estimate without the CPU heap's slack (what a GPU's allocator
    # would count); the resident set against the whole estimate.
    return {"live_peak": start + peak, "rss_peak": rss_peak,
            "estimate": estimate.total - estimate.heap_slack_bytes,
            "estimate_rss": estimate.total, "state": estimate.state_bytes,
            "activations": estimate.activation_bytes}


def measure(rounds: int, reps: int) -> dict:
    from plugtron.testing import DistributedPool

    torch.set_num_threads(2)
    out = {"load_before": os.getloadavg()[0],
           "layers": [layer_speed(seq, rounds, reps) for seq in (1024, 4096)]}
    with DistributedPool(1, timeout=1800) as pool:
        out["memory"] = pool.run(_live_peak, MODEL)[0]
    out["load_after"] = os.getloadavg()[0]
    return out


TEMPLATE = """## Multi-latent attention: layer speed against transformers, and the estimate ({date})

Machine: 2-core CPU (AVX-512, AMX); 1-minute load average {load_before:.1f} at the start,
{load_after:.1f} at the end. Command: `{command}`

**One MLA layer, forward + backward**, fp32, batch 1, two threads: hidden {hidden}, {heads}
heads, q rank {q_rank}, kv rank {kv_rank}, qk head {qk} + rotary {pos}, v head {v}; the same
weights in both (outputs equal within 1e-4). transformers' DeepseekV3Attention on its SDPA
path. Median over {rounds} alternating rounds of the median of {reps} passes.

| seq | plugtron (s) | transformers (s) | tokens/s ratio |
|---|---|---|---|
{layers}

**Estimate against the live-tensor peak**, one process: a DeepSeek-V3 shape in miniature (4
layers, hidden 256, MLA q rank 128 / kv rank 64, one dense layer then 3 MoE layers of 8 experts
top-2 with a shared expert and sigmoid routing, one MTP layer, seq 512, micro batch 2, global
batch 4, fp32, Adam). "live peak": the third iteration under torch.profiler, the most bytes of
live tensors over those alive at its start (parameters, gradient buffers, optimizer state);
"peak RSS": the resident-set high-water mark of the first two iterations over the resident set
before setup. "estimate": without the CPU heap's slack (what a GPU's allocator would count),
against the live peak; "estimate with slack": the CPU total, against the resident set.

| live peak MiB | peak RSS MiB | estimate MiB | estimate / live | estimate with slack MiB | estimate with slack / RSS | of which state MiB | activations MiB |
|---|---|---|---|---|---|---|---|
| {live:.1f} | {rss:.1f} | {estimate:.1f} | {ratio:.2f} | {estimate_rss:.1f} | {rss_ratio:.2f} | {state:.1f} | {activations:.1f} |
"""


def report(results: dict, rounds: int, reps: int, command: str) -> str:
    mib = 1 / 2**20
    layers = [f"| {r['seq']} | {r['plugtron']:.3f} | {r['transformers']:.3f} | "
              f"**{r['ratio']:.2f}x** |" for r in results["layers"]]
    m = results["memory"]
    return TEMPLATE.format(
        date=datetime.date.today().isoformat(), command=command, rounds=rounds, reps=reps,
        load_before=results["load_before"], load_after=results["load_after"], hidden=HIDDEN,
        heads=HEADS, q_rank=Q_RANK, kv_rank=KV_RANK, qk=QK, pos=POS, v=V,
        layers="\n".join(layers), live=m["live_peak"] * mib, estimate=m["estimate"] * mib,
        ratio=m["estimate"] / m["live_peak"], state=m["state"] * mib,
        rss=m["rss_peak"] * mib, rss_ratio=m["estimate_rss"] / m["rss_peak"],
        estimate_rss=m["estimate_rss"] * mib,
        activations=m["activations"] * mib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--reps", type=int, default=3, help="passes per layer per round")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    command = "python benchmarks/bench_mla.py" + (
        f" --rounds {args.rounds}" if args.rounds != 5 else "") + (
        f" --reps {args.reps}" if args.reps != 3 else "")
    text = report(measure(args.rounds, args.reps), args.rounds, args.reps, command)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
