"""Reading the pickles of a Megatron-Core ``torch_dist`` checkpoint without running code from it.

A pickle is a program: ``find_class`` names any importable callable and ``REDUCE`` calls it, so
``pickle.load`` on an untrusted file can run ``os.system``. Here ``find_class`` admits only the
names listed in :data:`ALLOWED` and refuses anything else with a ``CheckpointError`` naming the
class. What an admitted name resolves to is chosen here, never imported from the name:

* data-only stand-ins (:class:`Record`) for the dataclasses of ``torch.distributed.checkpoint``'s
  ``.metadata`` and for Megatron's enums in the saved ``args``: they keep the pickled state and
  run nothing;
* plain values for ``torch.Size`` (a tuple of ints), dtypes, layouts and memory formats;
* our own tensor rebuild for ``torch.save`` archives (``common.pt`` and every tensor item of a
  ``.distcp`` shard), which checks offset, size and stride against the stored bytes;
* paths (``pathlib.PosixPath``) as strings;
* ``collections.OrderedDict``, ``argparse.Namespace``, ``types.SimpleNamespace``, ``set`` and
  ``frozenset``, whose construction runs no code named by the file.

Megatron, torch and numpy are never imported to read a checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import io
import math
import pickle
import types
import zipfile

import torch
from plugtron.core.errors import CheckpointError


class Record:
    """A stand-in for an admitted class: keeps its constructor arguments and pickled state."""

    kind = "record"
    args: tuple = ()  # NEWOBJ creates instances without calling __init__
    state = None

    def __init__(self, *args):
        self.args = args
        self.state = None

    def __setstate__(self, state):  # BUILD: just keep it
        self.state = state

    def field(self, name: str, position: int | None = None, default=None):
        """A field of the pickled state: a dict, a ``(dict, slots)`` pair, or a tuple (the
        ``__getstate__`` of ``TensorProperties``)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and all(
                s is None or isinstance(s, dict) for s in state):
            merged = {**(state[0] or {}), **(state[1] or {})}
            return merged.get(name, default)
        if isinstance(state, dict):
            return state.get(name, default)
        if isinstance(state, tuple) and position is not None and position < len(state):
            return state[position]
        return default

    def __repr__(self):
        if self.args:
            return f"{self.kind}({', '.join(map(repr, self.args))})"
        return f"{self.kind}({self.state!r})"


def _record_class(qualified: str) -> type:
    return type(qualified.rsplit(".", 1)[-1], (Record,), {"kind": qualified})


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: Classes stored in a ``torch.distributed.checkpoint`` ``.metadata`` file (torch 2.1 to 2.13).
DCP_CLASSES = tuple(f"{_DCP_METADATA}.{name}" for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")) + (
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.planner.WriteItemType",
    # Megatron keeps its cached save plans in the metadata (``planner_data`` / ``mcore_data``).
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.TensorWriteData")
#: Modules of Megatron-Core enums that its saved ``args`` hold (e.g. ``attention_backend``):
#: every name in them reads as a data-only Record, nothing of Megatron is imported.
MEGATRON_ENUM_MODULES = ("megatron.core.enums", "megatron.core.transformer.enums",
                         "megatron.core.transformer.moe.moe_utils",
                         "megatron.core.inference.contexts")

_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "bool", "complex64", "complex128", "float", "double", "half", "long",
                "int", "short")
_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64,
             "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
             "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8,
             "ByteStorage": torch.uint8, "BoolStorage": torch.bool}


class _StorageType:
    """What ``torch.FloatStorage`` & co. resolve to: only the dtype, for ``persistent_load``."""

    def __init__(self, dtype):
        self.dtype = dtype


def _size(dims=()):
    """``torch.Size(dims)`` as a plain tuple of non-negative ints."""
    dims = tuple(dims)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise CheckpointError(f"a pickled torch.Size holds {dims!r}, not sizes")
    return dims


def _layout(name):
    """``torch.serialization._get_layout(name)``: how a layout pickles; dense only."""
    if name != "torch.strided":
        raise CheckpointError(f"a pickled tensor property has layout {name!r}; only "
                              f"torch.strided is read")
    return torch.strided


def _path(*parts):
    """``pathlib.PosixPath(*parts)`` (DCP's ``StorageMeta.checkpoint_id``) as a plain string."""
    if not all(isinstance(p, str) for p in parts):
        raise CheckpointError(f"a pickled path holds {parts!r}")
    return "/".join(parts)


def _allowed() -> dict[str, object]:
    """What each global a pickle may name loads as (a class, a function that rebuilds it, or
    a constant such as a dtype)."""
    table: dict[str, object] = {name: _record_class(name) for name in DCP_CLASSES}
    table.update({
        "collections.OrderedDict": collections.OrderedDict,
        "argparse.Namespace": argparse.Namespace,
        "types.SimpleNamespace": types.SimpleNamespace,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "torch.Size": _size,
        "pathlib.PosixPath": _path,
        "pathlib.PurePosixPath": _path,
        "torch.strided": torch.strided,
        "torch.serialization._get_layout": _layout,
        "torch.contiguous_format": torch.contiguous_format,
        "torch.channels_last": torch.channels_last,
        "torch.preserve_format": torch.preserve_format,
        "torch._utils._rebuild_tensor_v2": None,  # bound per archive (needs its storages)
    })
    table.update({f"torch.{n}": getattr(torch, n) for n in _DTYPE_NAMES})
    table.update({f"torch.{n}": _StorageType(d) for n, d in _STORAGES.items()})
    return table


#: ``module.name`` -> what it reads as. Anything else is refused.
ALLOWED = _allowed()


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` admits only :data:`ALLOWED` (and Megatron's enum
    modules as Records). ``where`` names the file in errors."""

    def __init__(self, data: bytes, where: str, storages=None):
        super().__init__(io.BytesIO(data))
        self.where = where
        self.storages = storages  # key -> bytes, for a torch.save archive

    def find_class(self, module, name):
        qualified = f"{module}.{name}"
        if qualified == "torch._utils._rebuild_tensor_v2" and self.storages is not None:
            return _rebuild_tensor_v2
        if qualified in ALLOWED and ALLOWED[qualified] is not None:
            return ALLOWED[qualified]
        if module in MEGATRON_ENUM_MODULES and name.isidentifier():
            return _record_class(qualified)
        raise CheckpointError(f"{self.where}: the pickle asks for {qualified!r}, which a "
                              f"Megatron-Core torch_dist checkpoint does not need; refused "
                              f"(nothing from the file was run). Admitted: DCP metadata "
                              f"classes, torch sizes/dtypes/tensors, OrderedDict, "
                              f"argparse.Namespace, Megatron enums")

    def persistent_load(self, pid):
        if self.storages is None:
            raise CheckpointError(f"{self.where}: unexpected persistent reference in a pickle")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[4], int)):
            raise CheckpointError(f"{self.where}: malformed storage reference {pid!r}")
        _, kind, key, _location, numel = pid
        raw = self.storages.get(key)
        itemsize = torch.empty((), dtype=kind.dtype).element_size()
        if raw is None or len(raw) != numel * itemsize:
            raise CheckpointError(f"{self.where}: storage {key!r} is missing or not "
                                  f"{numel} x {itemsize} bytes")
        flat = torch.frombuffer(bytearray(raw), dtype=kind.dtype) if raw else \
            torch.empty(0, dtype=kind.dtype)
        return flat


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None,
                       metadata=None):
    """Our own ``torch._utils._rebuild_tensor_v2``: a view of the stored bytes after checking
    that every element it reaches lies inside them."""
    if not isinstance(storage, torch.Tensor):
        raise CheckpointError("a pickled tensor does not refer to a storage")
    size, stride = _size(size), _size(stride)
    if not isinstance(offset, int) or offset < 0 or len(size) != len(stride):
        raise CheckpointError(f"a pickled tensor has offset {offset!r}, size {size} and "
                              f"stride {stride}")
    if math.prod(size) and offset + sum((n - 1) * s for n, s in zip(size, stride)) \
            >= storage.numel():
        raise CheckpointError(f"a pickled tensor of size {size} reaches past its "
                              f"{storage.numel()}-element storage")
    return torch.as_strided(storage, size, stride, offset).clone()


def loads(data: bytes, where: str):
    """A plain pickle (``.metadata``)."""
    try:
        return RestrictedUnpickler(data, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any damage is the file's, reported as such
        raise CheckpointError(f"{where} is not a readable pickle ({type(exc).__name__}: "
                              f"{exc})") from None


def load_torch_archive(data: bytes, where: str):
    """What ``torch.save`` wrote (the zip format of torch >= 1.6), tensors included."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CheckpointError(f"{where} is not a torch.save archive ({exc}); the legacy "
                              f"(pre-1.6) format is not read") from None
    pkl = [i for i in infos if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise CheckpointError(f"{where}: a torch.save archive has one <name>/data.pkl")
    prefix = pkl[0].filename[:-len("data.pkl")]
    storages = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
            raise CheckpointError(f"{where}: entry {info.filename!r} is compressed or larger "
                                  f"than the archive; torch.save stores entries plainly")
        if info.filename.startswith(prefix + "data/"):
            storages[info.filename[len(prefix) + 5:]] = archive.read(info)
    order = prefix + "byteorder"
    if order in archive.namelist() and archive.read(order) not in (b"little", b""):
        raise CheckpointError(f"{where}: big-endian archives are not read")
    try:
        return RestrictedUnpickler(archive.read(pkl[0]), where, storages).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{where}: data.pkl is not a readable pickle "
                              f"({type(exc).__name__}: {exc})") from None
