"""Megatron-Core's ``torch_dist`` checkpoint directory, read and written without Megatron.

Layout (Megatron's ``dist_checkpointing`` with ``torch.distributed.checkpoint`` underneath)::

    SAVE_DIR/latest_checkpointed_iteration.txt   "5" (or "release")
    SAVE_DIR/iter_0000005/metadata.json          {"sharded_backend": "torch_dist", ...}
    SAVE_DIR/iter_0000005/common.pt              torch.save of the non-sharded state (args, ...);
                                                 since Megatron-Core 0.14 the object
                                                 ``common_state`` in the .distcp files instead
    SAVE_DIR/iter_0000005/.metadata              pickled DCP Metadata: every key's global shape,
                                                 dtype and chunks, and where each chunk is stored
    SAVE_DIR/iter_0000005/__0_0.distcp ...       the chunks: each tensor chunk a torch.save
                                                 archive at (offset, length); objects raw bytes

Keys are global (``decoder.layers.self_attention.linear_qkv.weight``), and a tensor's chunks
(one per tp/pp/dp shard that wrote it) tile its global shape, so the reader assembles global
tensors whatever layout wrote them. Every pickle is read with restricted_pickle (no code from the
file runs); every chunk's file name, offset and length are checked against the directory and the
file's size before a byte is read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp
from plugtron.core.checkpoint.safe_files import (
    check_plain_name,
    open_regular,
    read_small,
    regular_file_size,
)
from plugtron.core.checkpoint.schema import check_tiling
from plugtron.core.errors import CheckpointError
from plugtron.core.interchange import restricted_pickle as rp
from torch.distributed.checkpoint import DefaultSavePlanner

LATEST = "latest_checkpointed_iteration.txt"
METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
COMMON = "common.pt"
_ITER = re.compile(r"iter_(\d{7})$")


def iteration_dir(path: str) -> str:
    """The ``iter_XXXXXXX`` (or ``release``) directory that ``path`` is or names: the one that
    ``latest_checkpointed_iteration.txt`` points at, else the newest with a ``.metadata``."""
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.lexists(latest):
        text = read_small(latest, 64).decode(errors="replace").strip()
        name = "release" if text == "release" else None
        if name is None and text.isdigit():
            name = f"iter_{int(text):07d}"
        if name is None:
            raise CheckpointError(f"{latest} holds {text!r}: an iteration number or 'release'")
        found = os.path.join(path, name)
        if not os.path.isfile(os.path.join(found, DCP_METADATA)):
            raise CheckpointError(f"{latest} names {name}, which has no {DCP_METADATA}: not a "
                                  f"torch_dist checkpoint (only --ckpt-format torch_dist reads)")
        return found
    iters = sorted(n for n in os.listdir(path) if _ITER.match(n)
                   and os.path.isfile(os.path.join(path, n, DCP_METADATA)))
    if not iters:
        raise CheckpointError(f"{path!r} is not a Megatron-Core torch_dist checkpoint: no "
                              f"{DCP_METADATA}, no {LATEST}, no iter_XXXXXXX with {DCP_METADATA}")
    return os.path.join(path, iters[-1])


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], object]]  # offsets, sizes, storage


@dataclass
class TorchDistCheckpoint:
    """The parts of one iteration directory; tensors are read on demand (:meth:`read`)."""

    directory: str
    config: dict
    common: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)  # ShardedObject keys (bytes)
    object_storage: dict = field(default_factory=dict)
    _sizes: dict[str, int] = field(default_factory=dict)

    def read(self, key: str) -> torch.Tensor:
        """The global tensor ``key``, assembled from its chunks (each checked)."""
        info = self.tensors[key]
        _check_disjoint(self.directory, key, info)
        out = torch.empty(info.shape, dtype=info.dtype)
        covered = 0
        for offsets, sizes, storage in info.chunks:
            chunk = self._chunk(key, storage)
            if tuple(chunk.shape) != sizes or chunk.dtype != info.dtype:
                raise CheckpointError(f"{self.directory}: chunk of {key!r} at {offsets} holds "
                                      f"{chunk.dtype} {tuple(chunk.shape)}, the metadata says "
                                      f"{info.dtype} {sizes}")
            view = out
            for dim, (o, n) in enumerate(zip(offsets, sizes)):
                view = view.narrow(dim, o, n)
            view.copy_(chunk)
            covered += math.prod(sizes)
        if covered != math.prod(info.shape):
            raise CheckpointError(f"{self.directory}: the chunks of {key!r} cover {covered} of "
                                  f"its {math.prod(info.shape)} elements")
        return out

    def read_object(self, key: str):
        """A ShardedObject: Megatron stores ``torch.save([data of each shard])`` as raw bytes;
        read with the restricted unpickler."""
        data = self._bytes(key, self.object_storage[key])
        where = f"{self.directory} ({key!r})"
        value = rp.load_torch_archive(data, where)
        if not (isinstance(value, list) and len(value) == 1):
            raise CheckpointError(f"{where}: a Megatron sharded object holds a one-item list")
        return value[0]

    def _chunk(self, key: str, storage) -> torch.Tensor:
        data = self._bytes(key, storage)
        tensor = rp.load_torch_archive(data, f"{self.directory} ({key!r})")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{self.directory}: chunk of {key!r} is not a tensor")
        return tensor

    def _bytes(self, key: str, storage) -> bytes:
        name = check_plain_name(storage.field("relative_path"), self.directory,
                                f"storage of {key!r}")
        offset, length = storage.field("offset"), storage.field("length")
        if storage.field("transform_descriptors"):
            raise CheckpointError(f"{self.directory}: {key!r} is stored with transforms "
                                  f"{storage.field('transform_descriptors')!r}; only plain "
                                  f"torch.save chunks are read")
        if name not in self._sizes:
            self._sizes[name] = regular_file_size(self.directory, name, self.directory,
                                                  f"storage of {key!r}")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0
                and length > 0 and offset + length <= self._sizes[name]):
            raise CheckpointError(f"{os.path.join(self.directory, name)}: {key!r} is said to "
                                  f"lie at bytes [{offset}, +{length}) of a "
                                  f"{self._sizes[name]}-byte file")
        with open_regular(os.path.join(self.directory, name)) as f:
            f.seek(offset)
            return f.read(length)


def _check_disjoint(directory: str, key: str, info: TensorInfo) -> None:
    """The chunks lie inside the tensor and tile it exactly once, so no element is left as
    uninitialised memory (schema.check_tiling: O(n log n), no pairwise comparison; a tp x pp
    save gives a stacked key one chunk per layer and tp rank)."""


    chunks = [SimpleNamespace(offset=tuple(c[0]), shape=tuple(c[1])) for c in info.chunks]
    check_tiling(key, tuple(info.shape), chunks, directory)


def _dims(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise CheckpointError(f"{where}: expected sizes, got {value!r}")
    return value


def read_torch_dist(path: str) -> TorchDistCheckpoint:
    """Open a ``torch_dist`` checkpoint: ``metadata.json``, ``common.pt`` and ``.metadata``."""
    directory = iteration_dir(path)
    regular_file_size(directory, METADATA_JSON, directory, METADATA_JSON)
    try:
        config = json.loads(read_small(os.path.join(directory, METADATA_JSON)))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{directory}/{METADATA_JSON} is not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist":
        raise CheckpointError(f"{directory}/{METADATA_JSON}: sharded_backend is "
                              f"{config.get('sharded_backend') if isinstance(config, dict) else config!r}"
                              f"; only 'torch_dist' is read")
    common = {}
    if os.path.lexists(os.path.join(directory, COMMON)):
        regular_file_size(directory, COMMON, directory, COMMON)
        with open_regular(os.path.join(directory, COMMON)) as f:
            common = rp.load_torch_archive(f.read(), os.path.join(directory, COMMON))
        if not isinstance(common, dict):
            raise CheckpointError(f"{directory}/{COMMON} does not hold a dict")
    where = os.path.join(directory, DCP_METADATA)
    regular_file_size(directory, DCP_METADATA, directory, DCP_METADATA)
    with open_regular(where) as f:
        meta = rp.loads(f.read(), where)
    if getattr(meta, "kind", None) != f"{rp._DCP_METADATA}.Metadata":
        raise CheckpointError(f"{where} does not hold a torch.distributed.checkpoint Metadata")
    state = meta.field("state_dict_metadata")
    storage = meta.field("storage_data")
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{where}: state_dict_metadata or storage_data is missing")
    located = {}
    for index, info in storage.items():
        if not isinstance(index, rp.Record) or not isinstance(info, rp.Record):
            raise CheckpointError(f"{where}: storage_data holds {index!r} -> {info!r}")
        offset = index.field("offset")
        located[(index.field("fqn"), tuple(offset) if offset is not None else None)] = info
    out = TorchDistCheckpoint(directory, config, common)
    for key, entry in state.items():
        kind = getattr(entry, "kind", "")
        if kind.endswith(".BytesStorageMetadata"):
            out.objects.append(key)
            if (key, None) in located:
                out.object_storage[key] = located[(key, None)]
            continue
        if not kind.endswith(".TensorStorageMetadata") or not isinstance(key, str):
            raise CheckpointError(f"{where}: entry {key!r} is {entry!r}")
        props = entry.field("properties")
        dtype = props.field("dtype", 0) if isinstance(props, rp.Record) else None
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{where}: {key!r} has no dtype")
        shape = _dims(entry.field("size"), f"{where}: size of {key!r}")
        chunks: list[tuple[tuple[int, ...], tuple[int, ...], object]] = []
        for chunk in entry.field("chunks") or ():
            offsets = _dims(chunk.field("offsets"), f"{where}: chunk of {key!r}")
            sizes = _dims(chunk.field("sizes"), f"{where}: chunk of {key!r}")
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o + n > s for o, n, s in zip(offsets, sizes, shape)):
                raise CheckpointError(f"{where}: chunk {offsets}+{sizes} of {key!r} lies "
                                      f"outside its shape {shape}")
            info = located.get((key, offsets))
            if info is None:
                raise CheckpointError(f"{where}: chunk {offsets} of {key!r} has no storage")
            chunks.append((offsets, sizes, info))
        out.tensors[key] = TensorInfo(shape, dtype, chunks)
    # Megatron-Core >= 0.14 keeps the common state (args, iteration) in the DCP files as the
    # object ``common_state`` instead of common.pt.
    shared = [k for k in out.objects if k.startswith("common_state/")]
    if not common and shared:
        value = out.read_object(shared[0])
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {shared[0]!r} does not hold a dict")
        out.common = value
    return out


def _raw_bytes_planner():

    class RawBytes(DefaultSavePlanner):
        """Writes an io.BytesIO's bytes as they are, as Megatron's planner does (the default
        one would torch.save the BytesIO object itself)."""

        def transform_object(self, write_item, object):
            return object

    return RawBytes


def write_torch_dist(parent: str, iteration: int, tensors: dict, common: dict) -> str:
    """A ``torch_dist`` checkpoint ``parent/iter_XXXXXXX`` that Megatron-Core's
    ``dist_checkpointing.load`` reads: one chunk per (global) tensor, written by
    ``torch.distributed.checkpoint`` itself in one process."""

    _RawBytesPlanner = _raw_bytes_planner()

    if os.path.exists(parent) and os.listdir(parent):
        raise CheckpointError(f"{parent!r} exists and is not empty; choose a new directory")
    directory = os.path.join(parent, f"iter_{iteration:07d}")
    os.makedirs(directory)
    # Tensors, and io.BytesIO for Megatron's ShardedObjects (stored as raw bytes).
    state = {k: v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v
             for k, v in tensors.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory),
             planner=_RawBytesPlanner(flatten_state_dict=False), no_dist=True)
    torch.save(common, os.path.join(directory, COMMON))
    with open(os.path.join(directory, METADATA_JSON), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    with open(os.path.join(parent, LATEST), "w") as f:
        f.write(str(iteration))
    return directory
