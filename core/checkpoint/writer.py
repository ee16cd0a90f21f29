"""Writing checkpoint files: one rank's shard files and manifest, then the commit.

Nothing here talks to other processes: the caller (saver.py) snapshots the state, runs
:func:`write_rank_files` on every rank (possibly in a background thread), makes sure every rank
finished, and then lets global rank 0 run :func:`commit`, which writes ``metadata.json`` last,
renames the temporary directory into place and only then replaces the ``latest`` pointer. A
process killed at any point before the rename leaves only a ``.tmp-*`` directory, which loading
ignores.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file

from . import jsonio, layout
from .pieces import Box

#: Test-only: seconds to sleep after each file a rank writes, so a test can kill a process in the
#: middle of a save. Never set in real runs.
TEST_DELAY_ENV = "PLUGTRON_CHECKPOINT_TEST_FILE_DELAY"


@dataclass
class TensorEntry:
    """One logical tensor (``model/<param>`` or ``optim/<param>/<key>``) as this rank holds it:
    its global shape and the boxes it writes, each with a CPU tensor ready to write."""

    logical: str
    global_shape: tuple[int, ...]
    boxes: list[tuple[Box, torch.Tensor]]


@dataclass
class RankSnapshot:
    """Everything one rank writes; taken on the main thread, written anywhere."""

    rank: int
    files: dict[str, list[TensorEntry]] = field(default_factory=dict)  # kind -> entries
    rng: dict | None = None
    info: dict = field(default_factory=dict)


def _test_delay() -> None:
    delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def write_rank_files(directory: str, snap: RankSnapshot) -> dict:
    """Write ``snap``'s safetensors files and manifest into ``directory``; returns the manifest."""
    os.makedirs(directory, exist_ok=True)
    files, tensors = {}, {}
    for kind, entries in snap.files.items():
        if not entries:
            continue
        name = layout.tensor_file_name(kind, snap.rank)
        payload = {}
        for entry in entries:
            record = {"global_shape": list(entry.global_shape), "pieces": []}
            for box, tensor in entry.boxes:
                key = f"{entry.logical}@{len(record['pieces'])}"
                payload[key] = tensor
                record["dtype"] = str(tensor.dtype).removeprefix("torch.")
                record["pieces"].append({"file": name, "key": key, "offset": list(box.offset),
                                         "shape": list(box.shape)})
            tensors[entry.logical] = record
        path = os.path.join(directory, name)
        save_file(payload, path, metadata={"format": "pt", "writer": "plugtron-checkpoint"})
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[name] = jsonio.file_digest(path)
        _test_delay()
    manifest = {"rank": snap.rank, "files": files, "tensors": tensors,
                "rng": jsonio.encode(snap.rng) if snap.rng is not None else None,
                "info": snap.info}
    jsonio.write_json(os.path.join(directory, layout.manifest_name(snap.rank)), manifest)
    _test_delay()
    return manifest


def commit(parent: str, tmp_dir: str, iteration: int, metadata: dict, ranks: list[int],
           update_latest: bool = True) -> str:
    """Global rank 0, after every rank wrote its files: write ``metadata.json`` (with each
    manifest's digest), rename into ``iter_XXXXXXX`` and point ``latest`` at it. Returns the
    final path."""
    manifests = {}
    for rank in ranks:
        name = layout.manifest_name(rank)
        manifests[name] = jsonio.file_digest(os.path.join(tmp_dir, name))
    jsonio.write_json(os.path.join(tmp_dir, layout.METADATA), {**metadata, "manifests": manifests})
    jsonio.fsync_dir(tmp_dir)
    final = os.path.join(parent, layout.iteration_dirname(iteration))
    if os.path.exists(final):
        # Saving an iteration again (a rerun into the same directory): move the old one aside
        # first; directories cannot be replaced atomically. A crash in between leaves the old
        # copy as ``.old-PID``, which the next run puts back (dir_lock.recover).
        trash = f"{final}.old-{os.getpid()}"
        os.rename(final, trash)
        _test_delay()
        os.rename(tmp_dir, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp_dir, final)
    jsonio.fsync_dir(parent)
    if update_latest:
        write_latest(parent, os.path.basename(final))
    remove_stale_tmp(parent)
    return final


def write_latest(parent: str, dirname: str) -> None:
    tmp = os.path.join(parent, f"{layout.LATEST}.tmp-{os.getpid()}")
    jsonio.write_bytes(tmp, (dirname + "\n").encode())
    os.replace(tmp, os.path.join(parent, layout.LATEST))
    jsonio.fsync_dir(parent)


def remove_stale_tmp(parent: str) -> None:
    """Temporary directories of saves that were interrupted (their process was killed)."""
    for name in os.listdir(parent):
        if name.startswith(layout.TMP_PREFIX + "iter_"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def write_single(directory: str, entries: list[TensorEntry], metadata: dict) -> str:
    """A checkpoint written by one process without a run (conversion from another format):
    ``directory`` becomes the checkpoint directory itself. Refuses to overwrite."""
    if os.path.exists(directory) and os.listdir(directory):
        from ..errors import CheckpointError

        raise CheckpointError(f"{directory!r} exists and is not empty; choose a new directory")
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{layout.TMP_PREFIX}{os.path.basename(directory)}-{os.getpid()}")
    write_rank_files(tmp, RankSnapshot(0, {"model": entries}))
    manifest = layout.manifest_name(0)
    digest = jsonio.file_digest(os.path.join(tmp, manifest))
    jsonio.write_json(os.path.join(tmp, layout.METADATA),
                      {**metadata, "manifests": {manifest: digest}})
    if os.path.exists(directory):
        os.rmdir(directory)
    os.rename(tmp, directory)
    return directory
