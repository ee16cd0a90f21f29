"""Writing checkpoint files: one rank's shard files and manifest, then the commit.

Nothing here talks to other processes: the caller (saver.py) snapshots the state, runs
:func:`write_rank_files` on every rank (possibly in a background thread), makes sure every rank
finished, and then lets global rank 0 run :func:`commit`, which writes ``metadata.json`` last,
renames the temporary directory into place (exchanges it with an existing one of the same
iteration, :func:`replace_dir`) and only then replaces the ``latest`` pointer. A process killed
at any point before the rename leaves only a ``.tmp-*`` directory, which loading ignores.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
from plugtron.core.checkpoint import jsonio, layout
from plugtron.core.checkpoint.pieces import Box
from plugtron.core.errors import CheckpointError
from safetensors.torch import save_file

#: Test-only: seconds to sleep after each file a rank writes, so a test can kill a process in the
#: middle of a save. Never set in real runs.
TEST_DELAY_ENV = "PLUGTRON_CHECKPOINT_TEST_FILE_DELAY"
#: Test-only: "1" makes a re-save use two renames, as where no atomic exchange exists.
TEST_NO_EXCHANGE_ENV = "PLUGTRON_CHECKPOINT_TEST_NO_EXCHANGE"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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
            pieces: list[dict] = []
            record: dict = {"global_shape": list(entry.global_shape), "pieces": pieces}
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
        replace_dir(tmp_dir, final)
    else:
        os.rename(tmp_dir, final)
    jsonio.fsync_dir(parent)
    if update_latest:
        write_latest(parent, os.path.basename(final))
    remove_stale_tmp(parent)
    return final


def replace_dir(new: str, final: str) -> None:
    """Put directory ``new`` in place of the existing directory ``final`` (saving an iteration
    again, a rerun into the same directory) so that ``final`` is never missing: on Linux one
    atomic exchange (renameat2 RENAME_EXCHANGE), after which ``new`` holds the old copy and is
    removed (a crash there leaves a ``.tmp-*`` that the next run removes). Where the exchange
    is unavailable, two renames: a crash between them leaves the old copy as
    ``final.old-PID``, which readers load in its place (layout.load_candidates) and the next
    run moves back (dir_lock.recover)."""
    if os.environ.get(TEST_NO_EXCHANGE_ENV) != "1" and exchange_dirs(new, final):
        _test_delay()
        shutil.rmtree(new, ignore_errors=True)
        return
    trash = f"{final}.old-{os.getpid()}"
    os.rename(final, trash)
    _test_delay()
    os.rename(new, final)
    shutil.rmtree(trash, ignore_errors=True)


def exchange_dirs(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the kernel, libc or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # glibc before 2.28, musl
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # this file system (or kernel) has no exchange
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


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
