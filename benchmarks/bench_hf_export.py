"""Peak memory of ``convert export-hf`` against the model's size.

Makes a random Llama-shaped Hugging Face model (default ~90M parameters, fp32), imports it once,
then exports the checkpoint in fresh processes, alternating rounds between

* ``streamed``: plugtron's export (a lazy checkpoint view, tensors written one at a time), and
* ``reference``: the whole-model path (every tensor read, the converter's output cloned, then
  ``safetensors.save_file``), which plugtron used before,

and reports each child's peak RSS above its own RSS after the imports (VmHWM, reset through
/proc/self/clear_refs; Linux only), and its peak anonymous memory sampled every few
milliseconds (RSS also counts the checkpoint's memory-mapped file pages).

    python benchmarks/bench_hf_export.py [--hidden 768 --layers 6 --vocab 32000 --rounds 3]
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
import json, sys
import torch
from plugtron.core.interchange import converters, hf_export
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.plugins.options import config_from_dict
from safetensors.torch import save_file

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

# The peak RSS a child inherits from its parent (ru_maxrss survives fork + exec) is reset here,
# after the imports, so the figure is what the export itself adds.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
start, anon_start = status("VmRSS"), status("RssAnon")
# Peak of anonymous memory (tensors), sampled: VmHWM also counts the checkpoint file's
# memory-mapped pages, which are page cache the kernel can drop, not memory the export holds.
import threading, time
peak_anon = [anon_start]
def sample():
    while True:
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
mode, ckpt, out = sys.argv[1:4]
if mode == "streamed":
    hf_export.export_hf(ckpt, out)
elif mode == "reference":
    reader = CheckpointReader(ckpt)
    config = config_from_dict(reader.config)
    conv = converters.converter_for_config(config)
    tensors = {}
    for name in reader.names("model/"):
        t = reader.read_full(f"model/{name}")
        tensors[name] = t[:config.model.vocab_size] if name in conv.vocab_tensors else t
    _, out_t = converters.run_export(conv, config, tensors)
    save_file({k: v.clone(memory_format=torch.contiguous_format) for k, v in out_t.items()},
              out + ".safetensors")
print(json.dumps({"extra_kb": status("VmHWM") - start, "anon_kb": peak_anon[0] - anon_start}))
"""


def child(mode: str, ckpt: str, out: str) -> tuple[float, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, ckpt, out], check=True,
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
    import transformers
    from plugtron.core.interchange.hf import import_hf

    root = tempfile.mkdtemp(prefix="bench-hf-export-")
    try:
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 128)
        model = transformers.LlamaForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(os.path.join(root, "hf"))
        del model
        import_hf(os.path.join(root, "hf"), os.path.join(root, "ckpt"))
        size_mb = params * 4 / 2**20
        results = {"streamed": [], "reference": []}
        for r in range(args.rounds):
            for mode in ("streamed", "reference") if r % 2 == 0 else ("reference", "streamed"):
                out = os.path.join(root, f"{mode}-{r}")
                results[mode].append(child(mode, os.path.join(root, "ckpt"), out))
                shutil.rmtree(out, ignore_errors=True)
                if os.path.exists(out + ".safetensors"):
                    os.remove(out + ".safetensors")
        print(f"model: {params / 1e6:.1f}M parameters, {size_mb:.0f} MiB fp32; "
              f"torch {torch.__version__}")
        print("| export | peak RSS incl. mapped file pages (MiB) | / model | peak anonymous "
              "memory, sampled (MiB) | / model | rounds (RSS / anonymous) |")
        print("|---|---|---|---|---|---|")
        for mode in ("streamed", "reference"):
            rss = statistics.median(v[0] for v in results[mode])
            anon = statistics.median(v[1] for v in results[mode])
            rounds = ", ".join(f"{a:.0f}/{b:.0f}" for a, b in results[mode])
            print(f"| {mode} | {rss:.0f} | {rss / size_mb:.2f}x | {anon:.0f} | "
                  f"{anon / size_mb:.2f}x | {rounds} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
