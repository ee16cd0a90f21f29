"""Peak memory of ``convert export-megatron`` and ``import-megatron`` against the model's size.

Saves a random Llama-shaped plugtron GPT (default ~90M parameters, fp32), then runs in fresh
processes, alternating the order every round:

* ``export streamed``: plugtron's export (the checkpoint read lazily, each stacked Megatron key
  built one layer at a time), and ``export reference``: the previous path (every tensor read
  into a dict first, then stacked, so the model is held twice);
* ``import streamed``: plugtron's import of that export (each stacked tensor freed once its
  layers are copied out, outputs handed to the writer one at a time), and ``import reference``:
  the previous path (the stacked tensors kept while every layer is cloned, then every output
  cloned again for the writer).

Each child reports its peak RSS above its RSS after the imports (VmHWM reset through
/proc/self/clear_refs; Linux only) and its peak anonymous memory sampled every 2 ms (RSS also
counts memory-mapped checkpoint pages, which are page cache, not memory the conversion holds).

    python benchmarks/bench_megatron_export.py [--hidden 768 --layers 6 --vocab 32000 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, threading, time
import torch
from plugtron.core.checkpoint import megatron, writer
from plugtron.core.interchange.converters import converter_for_config
from plugtron.core.interchange.torch_dist import read_torch_dist, write_torch_dist
from plugtron.core.config import padded_vocab_size

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start, anon_start = status("VmRSS"), status("RssAnon")
peak_anon = [anon_start]
def sample():
    while True:
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
mode, src, out = sys.argv[1:4]
if mode == "export streamed":
    megatron.export_megatron(src, out)
elif mode == "export reference":
    config, lazy, reader = megatron.checkpoint_tensors(src)
    tensors = {name: lazy[name] for name in lazy}  # the whole model first
    m = config.model
    args, state = converter_for_config(config).export_megatron(
        config, tensors, padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1))
    write_torch_dist(out, 0, state, {"args": args, "iteration": 0})
elif mode == "import streamed":
    megatron.import_megatron(src, out)
elif mode == "import reference":
    ckpt = read_torch_dist(src)
    kept = {k: ckpt.read(k) for k in ckpt.tensors if not megatron._skipped(k)}
    args = megatron._args_dict(ckpt.common.get("args"))
    conv = megatron._converter("gpt", "import_megatron")
    flags, got = conv.import_megatron(args, {}, dict(kept), set())  # stacked ones kept alive
    clones = [t.contiguous().clone() for _, t in sorted(got.items())]  # cloned for the writer
time.sleep(0.01)
print(json.dumps({"extra_kb": status("VmHWM") - start, "anon_kb": peak_anon[0] - anon_start}))
"""


def child(mode: str, src: str, out: str) -> tuple[float, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, src, out], check=True,
                          capture_output=True, text=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return got["extra_kb"] / 1024, got["anon_kb"] / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch
    from plugtron.core.checkpoint import checkpointer
    from plugtron.core.parallel.distributed import single_process
    from plugtron.core.plugins.options import config_from_flags
    from plugtron.core.training.loop import setup

    root = tempfile.mkdtemp(prefix="bench-megatron-export-")
    try:
        ckpt = os.path.join(root, "ckpt")
        config = config_from_flags({
            "num-layers": args.layers, "hidden-size": args.hidden,
            "num-attention-heads": args.hidden // 64, "num-query-groups": args.hidden // 128,
            "ffn-hidden-size": args.hidden * 8 // 3, "swiglu": True, "normalization": "RMSNorm",
            "position-embedding-type": "rope", "untie-embeddings-and-output-weights": True,
            "add-bias-linear": False, "vocab-size": args.vocab, "seq-length": 16,
            "micro-batch-size": 1, "global-batch-size": 1, "train-iters": 1, "data": "mock",
            "save": ckpt, "progress": False}, "bench")
        run = setup(config, world=single_process())
        params = sum(p.numel() for chunk in run.model_chunks for p in chunk.parameters())
        checkpointer(run).save(0)
        del run
        exported = os.path.join(root, "exported")
        megatron_export = __import__("plugtron.core.interchange.megatron",
                                     fromlist=["export_megatron"]).export_megatron
        megatron_export(ckpt, exported)
        size_mb = params * 4 / 2**20
        modes = {"export": (ckpt, ("export streamed", "export reference")),
                 "import": (exported, ("import streamed", "import reference"))}
        results = {m: [] for _, pair in modes.values() for m in pair}
        for r in range(args.rounds):
            for src, pair in modes.values():
                for mode in pair if r % 2 == 0 else pair[::-1]:
                    out = os.path.join(root, f"out-{r}")
                    results[mode].append(child(mode, src, out))
                    shutil.rmtree(out, ignore_errors=True)
        print(f"model: {params / 1e6:.1f}M parameters, {size_mb:.0f} MiB fp32; "
              f"torch {torch.__version__}")
        print("| path | peak RSS incl. mapped file pages (MiB) | / model | peak anonymous "
              "memory, sampled (MiB) | / model | rounds (RSS / anonymous) |")
        print("|---|---|---|---|---|---|")
        for mode, values in results.items():
            rss = statistics.median(v[0] for v in values)
            anon = statistics.median(v[1] for v in values)
            rounds = ", ".join(f"{a:.0f}/{b:.0f}" for a, b in values)
            print(f"| {mode} | {rss:.0f} | {rss / size_mb:.2f}x | {anon:.0f} | "
                  f"{anon / size_mb:.2f}x | {rounds} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
