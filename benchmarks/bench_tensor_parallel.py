"""Tensor parallelism side by side, on CPU with gloo.

1. Throughput: tp 2 on 2 ranks (1 thread each) against tp 1 on one rank (2 threads), same
   model, same global batch, same number of threads in total: tokens/s and the ratio.
2. Memory per rank at tp 1, 2, 4 (4 ranks; dp fills the rest), with and without sequence
   parallelism: parameter bytes (sharded and replicated parts) and activation bytes saved for
   backward by one microbatch's forward (counted with saved-tensor hooks, each storage once,
   parameters excluded).

Appends a section to benchmarks/RESULTS.md. Usage: python benchmarks/bench_tensor_parallel.py
"""

from __future__ import annotations

import datetime
import os
import pathlib
import statistics
import sys
import time

# Idle OpenMP threads sleep instead of spinning: on a 2-core machine shared with other jobs,
# spinning threads of a 2-thread process were 10-30x slower than one thread (measured). Must be
# set before torch starts OpenMP; the spawned ranks inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results import write_section  # noqa: E402

from tests.distributed.harness import DistributedPool  # noqa: E402
from tests.utils import tiny_config, train_in_process  # noqa: E402

MODEL = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128,
         "vocab_size": 4096, "make_vocab_size_divisible_by": 128, "micro_batch_size": 2,
         "global_batch_size": 4, "swiglu": True, "ffn_hidden_size": 352,
         "position_embedding_type": "rope", "normalization": "RMSNorm",
         "add_bias_linear": False}
STEPS, WARMUP, REPEATS = 5, 1, 3


def _tokens_per_sec(records) -> float:
    timed = records[WARMUP:]
    tokens = MODEL["global_batch_size"] * MODEL["seq_length"]
    return tokens * len(timed) / sum(r["step_time_s"] for r in timed)


def _train_rate(rank, world_size, overrides):
    records, _ = train_in_process(tiny_config(**MODEL, train_iters=STEPS, **overrides))
    return _tokens_per_sec(records)


def throughput() -> dict:
    from plugtron.core.parallel.distributed import single_process

    runs = {"tp1": [], "tp1_1thread": [], "tp2": []}
    with DistributedPool(2, timeout=600) as pool:
        for _ in range(REPEATS):  # interleaved, so a busy moment on the shared CPU hits all
            for key, threads in (("tp1", 2), ("tp1_1thread", 1)):
                torch.set_num_threads(threads)
                records, _ = train_in_process(tiny_config(**MODEL, train_iters=STEPS),
                                              world=single_process())
                runs[key].append(_tokens_per_sec(records))
            runs["tp2"].append(pool.run(_train_rate, {"tp": 2})[0])
    return {key: (statistics.median(values), values) for key, values in runs.items()}


def _memory(rank, world_size, tp, sp):
    from plugtron.core.parallel.sharding import is_tensor_parallel
    from plugtron.core.training.loop import data_iterators, setup

    # One microbatch per dp rank: the memory of one microbatch does not depend on dp.
    layout = {"tp": tp, "sequence_parallel": sp, "train_iters": 1,
              "global_batch_size": MODEL["micro_batch_size"] * world_size // tp}
    config = tiny_config(**{**MODEL, **layout})
    run = setup(config)
    chunk = run.model_chunks[0]
    params = list(chunk.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    sharded = sum(p.numel() * p.element_size() for p in params if is_tensor_parallel(p))
    replicated = sum(p.numel() * p.element_size() for p in params if not is_tensor_parallel(p))

    seen, saved = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in param_storages:
            seen.add(ptr)
            saved[0] += storage.nbytes()
        return t

    iterator = data_iterators(run, run.datasets[0], 0)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output, closure = run.forward_step_func(iterator, chunk)
        loss = closure(output)[0]
    loss.backward()
    return {"sharded": sharded, "replicated": replicated, "activations": saved[0]}


def memory() -> dict:
    out = {}
    with DistributedPool(4, timeout=600) as pool:
        for tp, sp in ((1, False), (2, False), (2, True), (4, False), (4, True)):
            out[(tp, sp)] = pool.run(_memory, tp, sp)[0]
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def _row(name: str, threads: str, rate) -> str:
    median, values = rate
    return f"| {name} | {threads} | {median:.0f} | {', '.join(f'{v:.0f}' for v in values)} |"


def report(rates: dict, mem: dict, seconds: float) -> str:
    base = mem[(1, False)]
    lines = [
        f"## Tensor parallelism ({datetime.date.today().isoformat()})",
        "",
        "Machine: 2-core CPU, gloo. The CPU is shared with other engineers' test runs while "
        f"this ran (load average {os.getloadavg()[0]:.1f} on 2 cores at the end), so "
        "throughput figures are noisy (median "
        f"of {REPEATS} interleaved runs of {STEPS} steps, the first {WARMUP} left out). "
        "`OMP_WAIT_POLICY=PASSIVE` is set: with spinning OpenMP threads the 2-thread tp 1 run "
        "was 10-30x slower than a 1-thread one on this loaded machine.",
        "",
        "Command: `python benchmarks/bench_tensor_parallel.py` "
        f"(took {seconds:.0f} s)",
        "",
        f"Model: {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_attention_heads']} heads, SwiGLU ffn {MODEL['ffn_hidden_size']}, "
        f"vocab {MODEL['vocab_size']}, seq {MODEL['seq_length']}, micro batch "
        f"{MODEL['micro_batch_size']}, global batch {MODEL['global_batch_size']}, fp32.",
        "",
        "### Throughput, 2 threads in total",
        "",
        "| layout | threads | tokens/s (median) | runs |",
        "|---|---|---|---|",
        _row("tp 1, 1 rank", "2", rates["tp1"]),
        _row("tp 2, 2 ranks", "1 + 1", rates["tp2"]),
        _row("(context) tp 1, 1 rank", "1", rates["tp1_1thread"]),
        "",
        f"Ratio tp 2 / tp 1 (2 threads): **{rates['tp2'][0] / rates['tp1'][0]:.2f}x**; "
        f"tp 2 / tp 1 with one thread: {rates['tp2'][0] / rates['tp1_1thread'][0]:.2f}x. "
        "On a CPU tp only divides the same arithmetic between the same two cores and adds "
        "the all-reduces (per layer and microbatch 2 in forward and 2 in backward) over gloo; "
        "it exists to fit models that one device cannot hold, which the memory table shows.",
        "",
        "### Memory per rank (rank 0, one microbatch's forward)",
        "",
        "| layout | sharded params MiB | replicated params KiB | activations MiB | "
        "params vs tp 1 | activations vs tp 1 |",
        "|---|---|---|---|---|---|",
    ]
    for (tp, sp), m in mem.items():
        total = m["sharded"] + m["replicated"]
        base_total = base["sharded"] + base["replicated"]
        lines.append(f"| tp {tp}{' + SP' if sp else ''} | {_mib(m['sharded'])} | "
                     f"{m['replicated'] / 1024:.1f} | {_mib(m['activations'])} | "
                     f"{total / base_total:.3f} | {m['activations'] / base['activations']:.3f} |")
    lines += [
        "",
        "Sharded parameters (linear weights, vocabulary) scale as 1/tp; the replicated ones "
        "(norm weights) stay (where the padded vocabulary grows with tp the embedding is "
        "slightly more than 1/tp; 4096 needs no extra padding up to tp 4). Without SP the "
        "activations of the residual stream, the norms and the inputs of the column-parallel "
        "linears are replicated and stay whole; with SP they are split along the sequence (the "
        "column-parallel linears keep only their sequence shard and all-gather it again in "
        "backward), so activations come to about 1/tp. What remains above 1/tp is per-token "
        "bookkeeping every rank keeps whole (token ids, masks, per-token losses).",
        "",
        "### GPU (`te` backend)",
        "",
        "`benchmarks/gpu_smoke.sh` (bf16, one GPU, `--layer-backend te` against `local`, "
        "prints tokens/s) needs CUDA and transformer-engine; it was not run for this section: "
        "the machine has no GPU.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    start = time.perf_counter()
    rates = throughput()
    mem = memory()
    text = report(rates, mem, time.perf_counter() - start)
    print(text)
    write_section(text)


if __name__ == "__main__":
    main()
