"""Seeding and the random streams of model parallelism.

The same seed and layout give bitwise-identical runs on CPU. Megatron's offsets:

* default stream: ``seed + 100 * pp_rank``, shared by tp and dp ranks, so dropout on replicated
  activations is the same on every tp rank;
* model-parallel stream: default + ``2718 + tp_rank``, for dropout inside tensor-parallel regions
  (attention probabilities of this rank's heads) and on sequence-sharded activations, which must
  differ across tp ranks;
* expert-parallel stream: default + ``1024 + 100 * ep_rank + etp_rank`` (MoE experts).

:class:`RNGStatesTracker` keeps the extra streams and swaps one in around a block of code
(:meth:`~RNGStatesTracker.fork`); checkpoints save and restore it with ``get_state`` /
``set_state``.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


def stage_seed(seed: int, parallel) -> int:
    return seed + 100 * parallel.pp_rank


def seed_everything(seed: int, parallel) -> None:
    """Megatron's offsets: each pipeline stage draws from its own stream (seed + 100 * pp
    rank); tp and dp ranks share it, so replicated activations see the same dropout."""
    seed = stage_seed(seed, parallel)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states for one device, swapped in with :meth:`fork`.

    Works on the default generator of ``device`` (the CPU generator, or the CUDA generator of
    that GPU), because that is what dropout draws from. transformer-engine accepts it as its
    ``get_rng_state_tracker`` (it only calls ``fork()``).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    # The default generator of the device, read and written as a state tensor.
    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` from ``seed`` (the default generator is left untouched)."""
        if name in self._states:
            raise ValueError(f"random stream {name!r} already exists")
        saved = self._get()
        try:
            if self.device.type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self._states[name] = self._get()
        finally:
            self._set(saved)

    def names(self) -> list[str]:
        return sorted(self._states)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream ``name`` inside the block; the default stream resumes afterwards
        where it left off, and stream ``name`` continues next time where this block stopped."""
        if name not in self._states:
            raise KeyError(f"random stream {name!r} was never added; streams: {self.names()}")
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)

    def get_state(self) -> dict[str, torch.Tensor]:
        """Copies of every stream's generator state (uint8 CPU tensors), for checkpoints."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_state(self, states: dict[str, torch.Tensor]) -> None:
        """Restore the streams ``get_state`` returned (replaces all streams)."""
        self._states = {name: state.clone().cpu() for name, state in states.items()}


def model_parallel_rng_tracker(seed: int, parallel) -> RNGStatesTracker:
    """A tracker with the model-parallel and expert-parallel streams of this rank."""
    tracker = RNGStatesTracker(parallel.device)
    base = stage_seed(seed, parallel)
    tracker.add(MODEL_PARALLEL_RNG, base + 2718 + parallel.tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, base + 1024 + 100 * parallel.ep_rank + parallel.etp_rank)
    return tracker
