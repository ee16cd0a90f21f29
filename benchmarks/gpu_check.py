"""The parts of the one-GPU check (benchmarks/gpu_check.sh) that are Python:

    python benchmarks/gpu_check.py losses       # a tiny GPT, fp32: CUDA's losses against CPU's
    python benchmarks/gpu_check.py mfu BACKEND  # a ~1B GPT, bf16: tokens/s and MFU on this GPU

Each prints one markdown line for benchmarks/RESULTS.md and exits 1 when its check fails (losses
apart by more than the stated tolerance). Run from the repository root (it imports tests.utils).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

#: dense bf16 peak (TFLOP/s) of the GPUs this check expects, by a piece of the device name;
#: another GPU: set GPU_PEAK_TFLOPS.
PEAKS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0,
         "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
#: The ~1B GPT: 16 layers of hidden 2048 (SwiGLU, GQA 16/4, RMSNorm, rope, no bias, untied):
#: about 0.85 B parameters with the 32k vocabulary.
BIG = ["--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
       "--num-attention-heads", "16", "--num-query-groups", "4", "--swiglu",
       "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--disable-bias-linear", "--untie-embeddings-and-output-weights",
       "--vocab-size", "32000", "--seq-length", "2048", "--micro-batch-size", "1",
       "--global-batch-size", "16", "--bf16", "--data", "mock", "--lr", "1e-4",
       "--eval-interval", "0", "--log-interval", "5", "--no-progress"]
WARMUP_ITERS = 5


def peak_tflops() -> float:
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"])
    name = torch.cuda.get_device_name()
    for key, value in PEAKS.items():
        if key in name:
            return value
    raise SystemExit(f"unknown GPU {name!r}: set GPU_PEAK_TFLOPS to its dense bf16 peak")


def losses() -> int:
    sys.path.insert(0, os.getcwd())
    from plugtron.core.parallel.distributed import single_process

    from tests.utils import tiny_config, train_in_process

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    runs = {}
    # CUDA with the output layer and loss fused (--cross-entropy-loss-fusion) against the same
    # CPU run too: the chunked loss's CUDA path
    for device, fused in (("cpu", False), ("cuda", False), ("cuda", True)):
        config = tiny_config(train_iters=10, swiglu=True, num_query_groups=2,
                             normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
                             cross_entropy_loss_fusion=fused)
        records, _ = train_in_process(config, world=single_process(device))
        runs[device, fused] = [r["lm_loss"] for r in records]
    failed = 0
    for fused in (False, True):
        worst = max(abs(g - c) / abs(c)
                    for g, c in zip(runs["cuda", fused], runs["cpu", False]))
        ok = worst <= 1e-4
        failed |= not ok
        what = "CUDA with --cross-entropy-loss-fusion" if fused else "CUDA"
        print(f"| tiny GPT fp32, 10 iterations | {what} vs CPU losses: largest relative "
              f"difference {worst:.1e} (tolerance 1e-4) | {'ok' if ok else 'FAILED'} |")
    return 1 if failed else 0


def mfu(backend: str, iters: int = 20) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        done = subprocess.run([sys.executable, "-m", "plugtron.cli.main", "train", *BIG,
                               "--layer-backend", backend, "--train-iters", str(iters),
                               "--metrics-file", metrics], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| ~1B GPT bf16, {backend} | did not run (exit {done.returncode}): "
                  f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''} | "
                  f"FAILED |")
            return 1
        with open(metrics) as f:
            records = [json.loads(line) for line in f if '"step_time_s"' in line]
    params = _parameters()
    tokens = 16 * 2048
    step = statistics.median(r["step_time_s"] for r in records[WARMUP_ITERS:])
    flops_per_token = 6 * params + 12 * 16 * 2048 * 2048  # weights, and attention's scores
    achieved = tokens / step * flops_per_token / 1e12
    print(f"| ~1B GPT ({params / 1e9:.2f} B) bf16, --layer-backend {backend}, seq 2048, "
          f"batch 16 | {tokens / step:,.0f} tokens/s, {step * 1e3:.0f} ms/step (median after "
          f"{WARMUP_ITERS}) | MFU {achieved / peak_tflops():.1%} of {peak_tflops():.0f} TFLOP/s "
          f"({torch.cuda.get_device_name()}) |")
    return 0


def _parameters() -> int:
    h, ffn, layers, vocab, groups, heads = 2048, 5632, 16, 32000, 4, 16
    kv = h // heads * groups
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h
    return layers * per_layer + 2 * vocab * h + h


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; this check runs on a GPU machine", file=sys.stderr)
        return 2
    if sys.argv[1:2] == ["losses"]:
        return losses()
    if sys.argv[1:2] == ["mfu"] and len(sys.argv) == 3:
        return mfu(sys.argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
