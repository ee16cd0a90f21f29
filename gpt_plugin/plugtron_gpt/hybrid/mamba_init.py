"""Layout-independent initialisers of the Mamba-2 mixer's own parameters (Megatron's choices).

Each draws the *full* tensor from a generator seeded by the run seed and the tensor's final
name (``normal_init``), so every layout starts from the weights one process has. Uniform draws
are a standard normal pushed through its CDF: the public API's seeded normal is all they need.
"""

from __future__ import annotations

import math

import torch
from plugtron.api import InitMethod, normal_init


def uniform_init(low: float, high: float, seed: int, key: str) -> InitMethod:
    def init(shape: tuple) -> torch.Tensor:
        z = normal_init(1.0, seed, key)(shape)
        return low + (high - low) * 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))

    return init


def a_log_init(seed: int, key: str) -> InitMethod:
    """``A = -exp(A_log)`` with ``-A`` uniform in [1, 16]."""
    return lambda shape: uniform_init(1.0, 16.0, seed, key)(shape).log()


def dt_bias_init(seed: int, key: str, dt_min: float = 1e-3, dt_max: float = 0.1,
                 dt_floor: float = 1e-4) -> InitMethod:
    """``softplus(dt_bias)`` log-uniform in [dt_min, dt_max]: the inverse softplus of it."""

    def init(shape: tuple) -> torch.Tensor:
        u = uniform_init(0.0, 1.0, seed, key)(shape)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_floor)
        return dt + torch.log(-torch.expm1(-dt))

    return init


def conv_init(kernel: int, seed: int, key: str) -> InitMethod:
    """torch's Conv1d default for a depthwise kernel: uniform in +-1/sqrt(kernel)."""
    bound = 1.0 / math.sqrt(kernel)
    return uniform_init(-bound, bound, seed, key)
