"""Checks made before any rank starts: paths the run will write, finite numbers, and whether
the run's memory estimate fits one rank's memory (``--no-memory-check`` skips that)."""

from __future__ import annotations

import math
import os

import click
from plugtron.core.errors import ConfigError


def check_finite(config) -> None:
    """A NaN or infinite float (``--lr nan``) would only fail deep inside torch."""
    for name, section in config.sections().items():
        for key, value in vars(section).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"--{key.replace('_', '-')} {value}: must be a finite number")


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_dir(path: str | None, flag: str) -> None:
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a file, not a directory")
    base = _existing_ancestor(path)
    if not os.path.isdir(base):
        raise ConfigError(f"{flag} {path!r}: {base!r} is a file, so the directory cannot be "
                          f"created")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: {base!r} is not writable")


def check_writable_file(path: str | None, flag: str) -> None:
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path!r} is not writable")
        return
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag)


def check_memory(config, world_size: int, ranks_on_node: int) -> None:
    """Refuse a run whose largest rank cannot fit (core/tools/estimate.py; ``plugtron
    estimate`` prints the table). A model that cannot be estimated (a meta build it does not
    support, a vocabulary only its data knows) is launched unchecked, with a warning."""
    from plugtron.core.tools.estimate import check_fits, estimate_memory

    try:
        estimate = estimate_memory(config, world_size)
    except ConfigError as exc:
        click.echo(f"plugtron: no memory check ({exc})", err=True)
        return
    except Exception as exc:  # noqa: BLE001 - a plugin's meta build failing must not stop a run
        click.echo(f"plugtron: no memory check (the estimate failed: {type(exc).__name__}: "
                   f"{exc})", err=True)
        return
    check_fits(estimate, ranks_on_node)
    announce_slow_steps(config, estimate, world_size, ranks_on_node)


#: Say what a step will cost when it takes longer than this (a first step of minutes with no
#: word looks like a hang: gpt2-124m on 2 CPU cores).
SLOW_STEP_S = 20.0


#: The share of the bare matmul rate a training step attains on CPU: measured on gpt2-124m
#: (micro batch 1, seq 1024) on a 2-core Xeon, 2026-12-06: 6.3 s per step predicted at 0.5,
#: 6.0-6.6 s measured.
CPU_EFFICIENCY = 0.5


def step_flops(config, estimate, world_size: int) -> float:
    """One rank's forward and backward of one step: 6 x parameters x tokens, plus attention's
    score and value products (12 x layers x hidden x sequence per token)."""
    p, t, m = config.parallel, config.training, config.model
    model_parallel = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                      * p.context_parallel_size)
    dp = max(1, world_size // model_parallel)
    tokens = t.global_batch_size * m.seq_length / dp / p.context_parallel_size
    layers = m.num_layers / p.pipeline_model_parallel_size
    attention = 12.0 * layers * m.hidden_size * m.seq_length / p.tensor_model_parallel_size
    return (6.0 * estimate.peak.parameters + attention) * tokens


def cpu_matmul_flops(threads: int) -> float:
    """This CPU's fp32 matmul rate with ``threads`` threads (a few 512 x 512 products)."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b  # warm up
        start, n = time.perf_counter(), 8
        for _ in range(n):
            a @ b
        return n * 2 * 512 ** 3 / max(time.perf_counter() - start, 1e-9)
    finally:
        torch.set_num_threads(before)


def announce_slow_steps(config, estimate, world_size: int, ranks_on_node: int) -> None:
    """On CPU, when a step will take long, say about how long before it starts."""
    import os

    import torch

    if torch.cuda.is_available():
        return
    threads = max(1, (os.cpu_count() or 1) // max(1, ranks_on_node))
    rate = cpu_matmul_flops(threads) * CPU_EFFICIENCY
    flops = step_flops(config, estimate, world_size)
    seconds = flops / rate
    if seconds < SLOW_STEP_S:
        return
    total = seconds * config.training.train_iters
    click.echo(f"plugtron: expect about {_duration(seconds)} per step on this CPU "
               f"({flops / 1e12:.1f} TFLOP per rank for {estimate.peak.parameters / 1e6:.0f}M "
               f"parameters, at about {rate / 1e9:.0f} GFLOP/s: half the matmul rate measured "
               f"here), {_duration(total)} for --train-iters {config.training.train_iters}; a "
               f"smaller --preset, --seq-length or --global-batch-size trains faster",
               err=True)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def preflight(config, world_size: int, memory_check: bool = True,
              ranks_on_node: int | None = None) -> None:
    check_finite(config)
    check_writable_dir(config.checkpoint.save, "--save")
    check_writable_file(config.logging.metrics_file, "--metrics-file")
    if memory_check:
        check_memory(config, world_size, ranks_on_node or world_size)
