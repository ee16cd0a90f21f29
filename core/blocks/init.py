"""Layout-independent weight initialisation.

Each parameter draws from its own generator, seeded by the run seed and the parameter's global
name (global layer number included). A layer asks for the *full* tensor and keeps its shard, so
any tp, pp or vp layout starts from exactly the weights that one process would: the basis of the
cross-layout equality tests and of resharding checkpoints.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

InitMethod = Callable[[tuple], torch.Tensor]


def generator_for(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)


def normal_init(std: float, seed: int, key: str) -> InitMethod:
    """Normal(0, std) for the full tensor named ``key``."""

    def init(shape: tuple) -> torch.Tensor:
        out = torch.empty(shape)
        if out.is_meta:  # a meta build (the memory estimate) has no values to draw
            return out
        return out.normal_(0.0, std, generator=generator_for(seed, key))

    return init


def scaled_normal_init(std: float, num_layers: int, seed: int, key: str) -> InitMethod:
    """Megatron's init for output projections: std / sqrt(2 * num_layers)."""
    return normal_init(std / math.sqrt(2.0 * num_layers), seed, key)
