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
