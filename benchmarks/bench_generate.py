"""Generation speed: plugtron's ``generate`` against transformers' ``generate`` on the same model.

A random Llama-layout model (made with transformers, imported with ``plugtron convert
import-hf``, exported again with ``convert export-hf``; transformers runs the exported copy).
Greedy, ``--new`` tokens after a ``--prompt``-token prompt, at batch 1 and 8, with and without
the KV cache on both sides. Rounds alternate the order of the four runs; the figures are the
medians of new tokens per second (batch x new tokens / wall time), and the ratio ours / theirs.
Both sides must produce the same tokens (checked every round). Appends a section to
benchmarks/RESULTS.md.

    python benchmarks/bench_generate.py [--rounds 3] [--new 32] [--no-results]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import transformers
from click.testing import CliRunner
from plugtron.api import generate, load_model
from plugtron.cli.main import cli
from results import write_section

MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
             initializer_range=0.2, rope_theta=10000.0)


def build(tmp: str):
    torch.manual_seed(0)
    hf_dir, ckpt, exported = (os.path.join(tmp, n) for n in ("hf", "ckpt", "exported"))
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).save_pretrained(hf_dir)
    for args in (["import-hf", hf_dir, ckpt], ["export-hf", ckpt, exported]):
        result = CliRunner().invoke(cli, ["convert", *args])
        if result.exit_code:
            sys.exit(result.output)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    hf.generation_config.eos_token_id = None
    return load_model(ckpt), hf


def timed(fn):
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf = build(tmp)
    rows = []
    for batch in (1, 8):
        prompts = torch.randint(0, MODEL["vocab_size"], (batch, args.prompt),
                                generator=torch.Generator().manual_seed(batch))
        runs = {
            "plugtron cache": lambda: generate(ours, prompts.tolist(), args.new,
                                               greedy=True).tokens,
            "plugtron no cache": lambda: generate(ours, prompts.tolist(), args.new,
                                                  greedy=True, use_cache=False).tokens,
            "transformers cache": lambda: hf.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                max_new_tokens=args.new, pad_token_id=0)[:, args.prompt:].tolist(),
            "transformers no cache": lambda: hf.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                max_new_tokens=args.new, pad_token_id=0,
                use_cache=False)[:, args.prompt:].tolist(),
        }
        names = list(runs)
        with torch.no_grad():
            for name in names:  # warm-up
                runs[name]()
            times = {name: [] for name in names}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                outputs = {}
                for name in order:
                    seconds, outputs[name] = timed(runs[name])
                    times[name].append(seconds)
                same = len({str(tokens) for tokens in outputs.values()}) == 1
                if not same:
                    sys.exit(f"batch {batch} round {r}: the four runs gave different tokens")
        rate = {n: batch * args.new / statistics.median(t) for n, t in times.items()}
        rows.append((batch, rate))
        print(f"batch {batch}: " + " | ".join(f"{n} {v:.0f} tok/s" for n, v in rate.items()),
              flush=True)
    if not args.no_results:
        write_results(args, rows)


def write_results(args, rows) -> None:
    lines = [
        "", f"## Generation: plugtron generate vs transformers generate "
        f"({time.strftime('%Y-%m-%d')})", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(nproc), torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads. Shared with other engineers' work during the "
        f"run: figures are noisy.", "",
        f"Command: `python benchmarks/bench_generate.py --rounds {args.rounds} --prompt "
        f"{args.prompt} --new {args.new}`. Random Llama-layout model (hidden 256, 4 layers, 8 "
        f"heads / 4 kv groups, ffn 688, vocab 2048, fp32, CPU), greedy, "
        f"{args.prompt}-token prompts, {args.new} new tokens; transformers runs the "
        f"`convert export-hf` copy; every round both sides gave the same tokens. Median new "
        f"tokens/s over {args.rounds} alternating rounds (after one warm-up each).", "",
        "| batch | plugtron cache | plugtron no cache | transformers cache | "
        "transformers no cache | ours/theirs cache | ours/theirs no cache |",
        "|---|---|---|---|---|---|---|"]
    for batch, r in rows:
        lines.append(
            f"| {batch} | {r['plugtron cache']:.0f} | {r['plugtron no cache']:.0f} | "
            f"{r['transformers cache']:.0f} | {r['transformers no cache']:.0f} | "
            f"{r['plugtron cache'] / r['transformers cache']:.2f} | "
            f"{r['plugtron no cache'] / r['transformers no cache']:.2f} |")
    write_section("\n".join(lines))


if __name__ == "__main__":
    main()
