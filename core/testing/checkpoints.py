"""A checkpoint saved under one layout resumes under another as if never interrupted."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from plugtron.core.checkpoint.layout import iteration_dirname
from plugtron.core.checkpoint.reader import CheckpointReader

from .compare import assert_records_close
from .config import merge_flags, world_size_of
from .layouts import layout_name
from .pool import DistributedPool
from .runs import pool_for, refuse_before_launch, train_run


def assert_checkpoint_reshards(flags: dict, save_layout: dict, load_layout: dict,
                               iters: int = 4, rtol: float = 1e-5,
                               pool: DistributedPool | None = None,
                               inspect: Callable[[str], None] | None = None) -> None:
    """Train ``iters`` iterations under ``save_layout``, saving at ``iters // 2``; resume that
    checkpoint under ``load_layout``: its iterations ``iters // 2 + 1 .. iters`` equal the
    uninterrupted run's.

    Layouts are dicts of flags as in :func:`assert_layouts_match` (``{"tp": 2}``,
    ``{"pp": 2, "dp": 2}``; dp defaults to 1). The model weights, the optimizer state, the
    iteration, the data position and the RNG state all have to survive the move for the losses
    to agree. The checkpoint goes to a temporary directory, removed afterwards.

    Tolerance (fp32): ``lm_loss`` and ``grad_norm`` relative ``rtol`` (default 1e-5) per resumed
    iteration. ``pool`` must hold the larger layout's world; without one, a pool is started.
    ``inspect``: called with the saved checkpoint's directory before the resume, for checks of
    what was written (e.g. with ``CheckpointReader``).
    """
    if iters < 2:
        raise ValueError(f"iters must be at least 2 to save half-way, got {iters}")
    half = iters // 2
    base = merge_flags(flags, {"train-iters": iters})
    save_flags, load_flags = merge_flags(base, save_layout), merge_flags(base, load_layout)
    worlds = world_size_of(save_flags), world_size_of(load_flags)
    what = f"resumed {layout_name(load_layout)} from {layout_name(save_layout)} at {half}"
    refuse_before_launch((save_flags, worlds[0]), (load_flags, worlds[1]))
    with tempfile.TemporaryDirectory(prefix="plugtron-reshard-") as save, \
            pool_for(max(worlds), pool) as p:
        continuous = train_run(merge_flags(save_flags, {"save": save, "save-interval": half}),
                               worlds[0], p).records
        load = os.path.join(save, iteration_dirname(half))
        if inspect is not None:
            inspect(load)
        resumed = train_run(merge_flags(load_flags, {"load": load}), worlds[1], p).records
    if [r["iteration"] for r in resumed] != list(range(half + 1, iters + 1)):
        raise AssertionError(f"{what}: resumed at iterations {[r['iteration'] for r in resumed]}"
                             f", expected {half + 1}..{iters}")
    assert_records_close(resumed, continuous[half:], rtol, f"{what} against the continuous run")


def read_checkpoint(path: str) -> dict:
    """A checkpoint (or the newest complete one in a directory of them) as plain data for a
    test's own checks: ``{"iteration", "config", "layout", "plugins", "tensors"}``, every tensor
    whole (assembled from the pieces of whatever layout wrote it) under its stored name
    (``model/...``, ``optimizer/...``). Reading verifies every file first, as loading does."""
    reader = CheckpointReader(path)
    try:
        meta = reader.metadata
        return {"iteration": meta["iteration"], "config": meta.get("config"),
                "layout": meta.get("layout"), "plugins": meta.get("plugins"),
                "tensors": {name: reader.read_full(name) for name in sorted(reader.tensors)}}
    finally:
        reader.close()
