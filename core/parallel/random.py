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
from plugtron.core.training.recompute import register_tracker

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
    ``get_rng_state_tracker``: it calls ``fork()``, and its checkpointing ``get_states()`` and
    ``set_states()`` (Megatron's names, aliases of :meth:`get_state` and :meth:`set_state`).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        register_tracker(self)  # a recomputed forward replays these streams too

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

    # Megatron's and transformer-engine's tracker names: TE's activation checkpointing saves
    # and restores the streams through them around a recomputed forward.
    def get_states(self) -> dict[str, torch.Tensor]:
        return self.get_state()

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.set_state(states)

    def reset(self) -> None:
        """Forget every stream (Megatron's ``reset``)."""
        self._states = {}


def model_parallel_rng_tracker(seed: int, parallel) -> RNGStatesTracker:
    """A tracker with the model-parallel and expert-parallel streams of this rank."""
    tracker = RNGStatesTracker(parallel.device)
    base = stage_seed(seed, parallel)
    tracker.add(MODEL_PARALLEL_RNG, base + 2718 + parallel.tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, base + 1024 + 100 * parallel.ep_rank + parallel.etp_rank)
    return tracker


# --------------------------------------------------------------------------- state for checkpoints
#
# Each source of randomness is a named provider (get, set). Checkpoints store
# ``get_rng_state()`` per global rank and hand it back to ``set_rng_state``. Code that owns more
# random state (the tensor-parallel RNG tracker, say) registers its own provider once, at import,
# and is saved and restored with the rest. Values may hold tensors; the checkpoint stores them
# without pickling.

_PROVIDERS: dict = {}


def register_rng_provider(name: str, get_state, set_state) -> None:
    """Add a source of random state: ``get_state() -> value``, ``set_state(value)``."""
    _PROVIDERS[name] = (get_state, set_state)


def _get_python():
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": list(internal), "gauss_next": gauss}


def _set_python(state) -> None:
    random.setstate((state["version"], tuple(state["internal"]), state["gauss_next"]))


def _get_numpy():
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy(state) -> None:
    np.random.set_state((state["kind"], np.asarray(state["keys"], dtype=np.uint32), state["pos"],
                         state["has_gauss"], state["cached_gaussian"]))


def _get_cuda():
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.get_rng_state_all()


def _set_cuda(state) -> None:
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state))


register_rng_provider("python", _get_python, _set_python)
register_rng_provider("numpy", _get_numpy, _set_numpy)
register_rng_provider("torch", torch.get_rng_state, torch.set_rng_state)
register_rng_provider("cuda", _get_cuda, _set_cuda)


def get_rng_state(tracker=None) -> dict:
    """Every registered provider's state, keyed by provider name; with ``tracker`` (an object
    with ``get_state()``/``set_state(state)``, like the layer backend's tensor-parallel RNG
    tracker) its streams too, under ``"tracker"``."""
    state = {name: get() for name, (get, _) in _PROVIDERS.items()}
    if tracker is not None:
        state["tracker"] = tracker.get_state()
    return state


def set_rng_state(state: dict, tracker=None) -> None:
    """Restore what ``get_rng_state`` returned. Providers absent on either side are left as
    they are (a CUDA state saved on a GPU machine is skipped on a CPU one)."""
    for name, value in state.items():
        if name in _PROVIDERS and value is not None:
            _PROVIDERS[name][1](value)
    if tracker is not None and state.get("tracker") is not None:
        tracker.set_state(state["tracker"])


def resume_seed(seed: int, iteration: int) -> int:
    """Seed for a run resumed at ``iteration`` under a different layout, where the saved
    per-rank states cannot be matched to the new ranks: deterministic in (seed, iteration) and
    different from the seed the run started with."""
    return (seed * 1_000_003 + 7919 * (iteration + 1)) % 2**31
