"""Multi-latent attention's KV cache: the bytes per token and layer that generation keeps (the
normed latent and the rotated shared key) against the expanded keys and values that the core
attention is given (what a cache of k and v would hold), measured on built models.

Two MLA shapes: the tiny one of the deepseek_v3 tests (moe_plugin/tests) and DeepSeek-V3's
attention (128 heads, kv_lora_rank 512, rope dim 64, qk 128, v 128, q_lora_rank 1536) on a narrow hidden
size (the cache does not depend on it), one layer, in fp32 and bf16. The latent side is
``InferenceState.bytes_per_token`` after a prompt; the expanded side is the k and v tensors that
reach ``core_attention`` (a forward pre-hook), per token. Also times one decode step after
``--context`` cached tokens (fp32, batch 1) and the part of it spent rebuilding the keys and
values from the latent (``linear_kv_up_proj`` over the cached prefix).

    python benchmarks/bench_mla_kv_cache.py [--context 1024] [--write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from plugtron.api import InferenceState, forward_context
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup
from plugtron.testing import make_config
from results import write_section

BASE = {"multi-latent-attention": True, "position-embedding-type": "rope",
        "normalization": "RMSNorm", "add-bias-linear": False, "num-layers": 1,
        "vocab-size": 128, "ffn-hidden-size": 64}
TINY = "tiny (the deepseek_v3 tests)"
SHAPES = {
    TINY: {"hidden-size": 32, "num-attention-heads": 4, "q-lora-rank": 12, "kv-lora-rank": 8,
           "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 6},
    "DeepSeek-V3 attention": {"hidden-size": 256, "num-attention-heads": 128,
                              "q-lora-rank": 1536, "kv-lora-rank": 512, "qk-head-dim": 128,
                              "qk-pos-emb-head-dim": 64, "v-head-dim": 128},
}
KEY = "decoder.layers.0.self_attention"


def build(shape: dict, dtype: torch.dtype):
    run = setup(make_config({**BASE, **shape, "progress": False}), world=single_process())
    model = run.model_chunks[0].module.eval().to(dtype)
    return model, model.decoder.layers["0"].self_attention


def measure(model, attention, length: int, time_step: bool = False) -> dict:
    """Prompt of ``length`` tokens, then one decode step; bytes per token of both forms."""
    seen: dict = {}

    def keep(_module, args):
        seen["k"], seen["v"] = args[1], args[2]

    hook = attention.core_attention.register_forward_pre_hook(keep)
    tokens = torch.randint(0, 128, (1, length + 1), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length + 1)[None]
    state = InferenceState(torch.ones(1, length + 1, dtype=torch.bool))
    out: dict = {}
    with forward_context(inference=state), torch.no_grad():
        model(tokens[:, :length], positions[:, :length])
        state.advance(length)
        steps, rebuilds = [], []
        for _ in range(5 if time_step else 1):
            start = time.perf_counter()
            model(tokens[:, length:], positions[:, length:])
            steps.append(time.perf_counter() - start)
            latent = state.cached(KEY)[0]
            start = time.perf_counter()
            attention.linear_kv_up_proj(latent)
            rebuilds.append(time.perf_counter() - start)
    hook.remove()
    k, v = seen["k"], seen["v"]
    assert k.shape[1] == length + 1  # the decode step saw the whole cached prefix
    out["latent"] = state.bytes_per_token(KEY)
    out["latent shapes"] = [tuple(t.shape[2:]) for t in state.cached(KEY)]
    out["expanded"] = k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size()
    out["expanded shapes"] = [tuple(k.shape[2:]), tuple(v.shape[2:])]
    out["step ms"] = statistics.median(steps) * 1e3
    out["rebuild ms"] = statistics.median(rebuilds) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--write", action="store_true", help="replace the RESULTS.md section")
    args = parser.parse_args()
    rows, timing = [], None
    for name, shape in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            model, attention = build(shape, dtype)
            timed = name != TINY and dtype == torch.float32
            r = measure(model, attention, args.context if timed else 8, time_step=timed)
            if timed:
                timing = (name, r)
            rows.append((name, str(dtype).removeprefix("torch."), r))
            print(f"{name} {dtype}: latent {r['latent']} B/token/layer {r['latent shapes']}, "
                  f"expanded {r['expanded']} B {r['expanded shapes']}, "
                  f"{r['expanded'] / r['latent']:.1f}x", flush=True)
    assert timing is not None
    print(f"{timing[0]} decode step after {args.context} tokens: {timing[1]['step ms']:.1f} ms, "
          f"of which rebuilding k/v {timing[1]['rebuild ms']:.1f} ms")
    if args.write:
        write_results(args, rows, timing)


def write_results(args, rows, timing) -> None:
    lines = [
        f"## MLA KV cache ({time.strftime('%Y-%m-%d')})", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(nproc), torch {torch.__version__}, threads: {torch.get_num_threads()}.", "",
        f"Command: `python benchmarks/bench_mla_kv_cache.py --context {args.context} --write`. "
        "Bytes per token per layer: what generation's cache holds (the normed latent and the "
        "rotated shared key, `InferenceState.bytes_per_token`) against the k and v the core "
        "attention is given (what a cache of expanded keys and values would hold), at tp 1; "
        "under tp N the expanded form is 1/N per rank, the latent is whole on each.",
        "", "| MLA shape | dtype | latent cache (B) | expanded k+v (B) | ratio |",
        "|---|---|---|---|---|"]
    for name, dtype, r in rows:
        lines.append(f"| {name} | {dtype} | {r['latent']} | {r['expanded']} | "
                     f"{r['expanded'] / r['latent']:.1f}x |")
    name, r = timing
    lines += ["", f"The price: every decode step rebuilds the keys and values of the cached "
              f"prefix. {name}, fp32, batch 1, after {args.context} tokens: one decode step "
              f"{r['step ms']:.1f} ms, of which `linear_kv_up_proj` over the prefix "
              f"{r['rebuild ms']:.1f} ms (median of 5). Absorbing the up-projection into the "
              f"query and output projections (not done) would remove this O(context) rebuild."]
    write_section("\n".join(lines))


if __name__ == "__main__":
    main()
