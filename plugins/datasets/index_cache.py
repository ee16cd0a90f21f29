"""Index arrays built once and kept on disk, keyed by everything they depend on.

A set of arrays (say a GPT split's document, sample and shuffle indices) is named by the SHA-256
of its description (corpus identity, split, sizes, seed, algorithm version), so any change of an
input is a new name and a stale index is never read. One rank per node builds (local rank 0;
the others wait at a barrier), files are written under a temporary name and renamed, the
description last, so a reader sees complete sets only. Arrays are saved without pickle and
loaded memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import numpy as np
import torch.distributed as dist

#: Bumped when an algorithm changes, so that old caches are not reused.
ALGORITHM_VERSION = 1


def description_hash(description: dict) -> str:
    text = json.dumps({**description, "algorithm": ALGORITHM_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _distributed():

    return dist if dist.is_available() and dist.is_initialized() else None


def builds_here() -> bool:
    """One rank per node builds: local rank 0 (the only rank without torch.distributed)."""
    dist = _distributed()
    if dist is None:
        return True
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def barrier() -> None:
    dist = _distributed()
    if dist is not None:
        dist.barrier()


def paths_for(cache_dir: str, stem: str, names: tuple[str, ...]) -> dict[str, str]:
    out = {name: os.path.join(cache_dir, f"{stem}-{name}.npy") for name in names}
    out["description"] = os.path.join(cache_dir, f"{stem}-description.json")
    return out


def complete(paths: dict[str, str]) -> bool:
    return all(os.path.isfile(p) for p in paths.values())


def save_set(paths: dict[str, str], arrays: dict[str, np.ndarray], description: dict) -> None:
    os.makedirs(os.path.dirname(paths["description"]), exist_ok=True)
    suffix = f".tmp{os.getpid()}"
    for name, array in arrays.items():
        with open(paths[name] + suffix, "wb") as f:
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(paths[name] + suffix, paths[name])
    with open(paths["description"] + suffix, "w") as f:
        json.dump(description, f, indent=1, sort_keys=True)
    os.replace(paths["description"] + suffix, paths["description"])


def load_set(paths: dict[str, str], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {name: np.load(paths[name], mmap_mode="r", allow_pickle=False) for name in names}


def cached(cache_dir: str, kind: str, description: dict, names: tuple[str, ...],
           build: Callable[[], dict[str, np.ndarray]], log=None) -> dict[str, np.ndarray]:
    """The arrays ``names`` for ``description``: from the cache, or built by ``build()`` on one
    rank per node and saved first. Collective under torch.distributed: every rank calls it for
    the same descriptions in the same order."""
    stem = f"{description_hash(description)}-{kind}"
    paths = paths_for(cache_dir, stem, names)
    if not complete(paths) and builds_here():
        arrays = build()
        if log is not None:
            log(f"built {kind} indices ({stem}) in {cache_dir}")
        save_set(paths, arrays, description)
    barrier()
    if not complete(paths):
        raise FileNotFoundError(f"the {kind} indices {stem} were not written to {cache_dir}: "
                                f"is --data-cache-path shared by the ranks of a node?")
    return load_set(paths, names)
