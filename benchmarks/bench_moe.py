"""MoE side by side in one run (CPU, fp32): appends a section to benchmarks/RESULTS.md.

1. grouped vs looped experts (one MoE layer, forward + backward);
2. an 8-expert top-2 MoE layer vs a dense MLP with the same active parameters (ffn of the dense
   MLP = 2 x the expert ffn), one rank; goal: MoE <= 1.3x dense;
3. allgather vs alltoall dispatchers at ep 2 (2 gloo ranks, the same MoE layer);
4. tokens per expert over training steps of a small model: no balancing, aux loss, expert bias
   (a PNG plot when matplotlib is installed, and the max/mean load of the last step).

Usage: python benchmarks/bench_moe.py [--steps 200] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

HIDDEN, FFN, TOKENS, EXPERTS = 256, 256, 2048, 8


def _config(**flags):
    from plugtron.testing import make_config

    base = {"hidden-size": HIDDEN, "ffn-hidden-size": FFN, "num-experts": EXPERTS,
            "moe-router-topk": 2, "swiglu": True, "num-layers": 1, "add-bias-linear": False,
            "num-attention-heads": 4}
    return make_config({**base, **flags})


def _layer(config, parallel=None):
    from plugtron.api import ParallelContext, load_plugin

    parallel = parallel or ParallelContext.build(1, 0)
    backend = load_plugin("layer_backend", "local")(config, parallel)
    if config.moe.num_experts:
        return load_plugin("layer", "moe")(config, backend, parallel, 1, 0)
    return load_plugin("layer", "mlp")(config, backend, parallel, 1, 0)


def _time(layer, x, repeats=7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000


def layer_timings() -> dict:
    torch.set_num_threads(1)
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    out = {}
    for name, flags in (("looped", {}), ("grouped", {"moe-grouped-gemm": True}),
                        ("dense (ffn 2x expert)", {"num-experts": None,
                                                   "ffn-hidden-size": 2 * FFN})):
        torch.manual_seed(0)
        out[name] = _time(_layer(_config(**flags)), x)
    return out


def _rank_dispatch(rank, world_size, dispatcher):
    from plugtron.api import ParallelContext

    torch.set_num_threads(1)
    parallel = ParallelContext.build(world_size, rank, ep=2)
    config = _config(**{"moe-token-dispatcher-type": dispatcher,
                        "expert-model-parallel-size": 2})
    layer = _layer(config, parallel)
    x = torch.randn(1, TOKENS // 2, HIDDEN, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    return _time(layer, x)


def dispatcher_timings() -> dict:
    from plugtron.testing import DistributedPool

    with DistributedPool(2) as pool:
        return {d: max(pool.run(_rank_dispatch, d)) for d in ("allgather", "alltoall")}


def balance(steps: int) -> dict:
    from plugtron.core.distributed import single_process
    from plugtron.core.metrics import MetricsLogger
    from plugtron.core.training import setup, train
    from plugtron.testing import make_config

    flags = {"num-experts": 8, "moe-router-topk": 2, "train-iters": steps, "num-layers": 2,
             "hidden-size": 64, "seq-length": 32, "micro-batch-size": 4,
             "global-batch-size": 8, "lr": 3e-3, "moe-per-layer-logging": False}
    runs = {"none": {}, "aux loss 1e-2": {"moe-aux-loss-coeff": 1e-2},
            "expert bias": {"moe-router-score-function": "sigmoid",
                            "moe-router-enable-expert-bias": True,
                            "moe-router-bias-update-rate": 1e-2}}
    out = {}
    for name, extra in runs.items():
        config = make_config({**flags, **extra})
        recorder = LoadRecorder()
        run = setup(config, extra_plugins=[recorder], world=single_process())
        train(run, MetricsLogger(config, rank=1))  # rank != 0: writes nothing
        out[name] = recorder.loads
    return out


class LoadRecorder:
    """Extension: max/mean tokens per expert of layer 1 at each step (into the metrics)."""

    def __init__(self):
        self.routers = []

    def plugtron_model_built(self, config, model_chunks, parallel):
        from plugtron_moe.router import TopKRouter

        self.routers = [m for c in model_chunks for m in c.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._count)
        self.counts = torch.zeros(config.moe.num_experts)
        self.loads = []

    def _count(self, module, args, output):
        if module is self.routers[0] and torch.is_grad_enabled():
            self.counts += output[1].sum(0)

    def plugtron_step_end(self, iteration, metrics):
        self.loads.append(float(self.counts.max() / self.counts.mean()))
        self.counts.zero_()


def _hookimpls():
    from plugtron.api import hookimpl

    LoadRecorder.plugtron_model_built = hookimpl(LoadRecorder.plugtron_model_built)
    LoadRecorder.plugtron_step_end = hookimpl(LoadRecorder.plugtron_step_end)


def plot(series: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plot)"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        ax.plot(range(1, len(values) + 1), values, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert (layer 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    _hookimpls()
    start = time.time()
    layers = layer_timings()
    dispatch = dispatcher_timings()
    loads = balance(args.steps)
    png = plot(loads, os.path.join(os.path.dirname(__file__), "moe_balance.png"))
    took = time.time() - start
    ratio = layers["looped"] / layers["dense (ffn 2x expert)"]
    lines = [f"\n## MoE ({time.strftime('%Y-%m-%d')})\n",
             f"Machine: {platform.machine()} {os.cpu_count()}-core CPU, torch "
             f"{torch.__version__}, 1 thread per rank, shared with other engineers' runs "
             f"(noisy). Command: `python benchmarks/bench_moe.py --steps {args.steps}` "
             f"(took {took:.0f} s).\n",
             f"One layer, hidden {HIDDEN}, {EXPERTS} experts top-2, expert ffn {FFN} (SwiGLU), "
             f"{TOKENS} tokens, forward + backward, median of 6 ms:\n",
             "| variant | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.1f} |" for name, ms in layers.items()]
    lines += [f"\nMoE (looped) / dense with the same active parameters: **{ratio:.2f}x** "
              f"(goal <= 1.3x). Grouped / looped: "
              f"{layers['grouped'] / layers['looped']:.2f}x (on CPU the batched "
              f"equivalent pads to the largest expert; torch's grouped mm runs on CUDA only).\n",
              f"Dispatchers at ep 2 (2 gloo ranks, {TOKENS // 2} tokens each, slowest rank): "
              + ", ".join(f"{d} {ms:.1f} ms" for d, ms in dispatch.items()) + ".\n",
              f"Balance over {args.steps} steps (2 layers, hidden 64, 8 experts top-2; max/mean "
              f"tokens per expert of layer 1; 1.0 is perfect): "
              + ", ".join(f"{n}: first {v[0]:.2f}, last {v[-1]:.2f}, mean of last 20 "
                          f"{statistics.mean(v[-20:]):.2f}" for n, v in loads.items())
              + f". Plot: {os.path.basename(png) if png.endswith('.png') else png}.\n"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
