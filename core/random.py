"""Seeding. The same seed and layout give bitwise-identical runs on CPU."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int, parallel) -> None:
    """Megatron's offsets: each pipeline stage draws from its own stream (seed + 100 * pp
    rank); tp and dp ranks share it, so replicated activations see the same dropout."""
    stage_seed = seed + 100 * parallel.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
