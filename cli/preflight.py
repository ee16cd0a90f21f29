"""Checks made before any rank starts: paths the run will write, finite numbers, and whether
the model and its activations can fit in one rank's memory at all."""

from __future__ import annotations

import math
import os

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


def memory_estimate(config, world_size: int) -> tuple[float, float]:
    """(model state, activations) in bytes per rank for a decoder-only transformer:
    12 L h^2 + V h parameters at 16 bytes each (weights, gradients, two Adam moments), and
    Megatron's activation estimate s b h (34 + 5 a s / h) bytes per layer, both split over tp
    and pp. Rough on purpose: it only has to tell a run that might fit from one that cannot."""
    m, p, t = config.model, config.parallel, config.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    h, layers, s, b = m.hidden_size, m.num_layers, m.seq_length, t.micro_batch_size
    heads = max(1, m.num_attention_heads or 1)
    vocab = m.vocab_size or 0
    params = (12 * layers * h * h + vocab * h) / (tp * pp)
    activations = s * b * h * (34 + 5 * heads * s / h) * layers / (tp * pp)
    return params * 16, activations


def available_memory() -> float:
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # noqa: BLE001 - no device information: fall back to host memory
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_memory(config, world_size: int) -> None:
    state, activations = memory_estimate(config, world_size)
    have = available_memory()
    if state + activations > have:
        gib = 2**30
        raise ConfigError(f"this run needs about {(state + activations) / gib:,.1f} GiB per rank "
                          f"({state / gib:,.1f} GiB of weights, gradients and optimizer state, "
                          f"{activations / gib:,.1f} GiB of activations for one microbatch); a "
                          f"rank has {have / gib:,.1f} GiB. Reduce --hidden-size, --num-layers, "
                          f"--micro-batch-size or --seq-length, or use more tp/pp")


def preflight(config, world_size: int) -> None:
    check_finite(config)
    check_writable_dir(config.checkpoint.save, "--save")
    check_writable_file(config.logging.metrics_file, "--metrics-file")
    check_memory(config, world_size)
