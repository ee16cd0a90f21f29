"""The shape of ``metadata.json`` and of each rank manifest, checked field by field.

A checkpoint is untrusted input: every field the reader uses is checked here for its type and
range before use, and every failure is a ``CheckpointError`` naming the file and the field, so
no malformed checkpoint reaches torch or Python as a TypeError/KeyError deep in a loader.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
from plugtron.core.checkpoint.pieces import volume
from plugtron.core.checkpoint.st_header import TORCH_DTYPES, is_shape
from plugtron.core.config import SECTIONS
from plugtron.core.errors import CheckpointError

_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
_MISSING = object()


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def field(obj: dict, key: str, where: str, check, what: str, name: str | None = None,
          optional: bool = False):
    """``obj[key]`` if ``check(value)``; else ``CheckpointError`` naming ``where`` and the
    field."""
    value = obj.get(key, _MISSING) if isinstance(obj, dict) else _MISSING
    label = name or key
    if value is _MISSING or (optional and value is None):
        if optional:
            return None
        raise CheckpointError(f"{where}: field {label} is missing")
    if not check(value):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(f"{where}: field {label} must be {what}, got {shown}")
    return value


def nonneg_int(v) -> bool:
    return is_int(v) and v >= 0


def is_digest(v) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("crc32"), str)
            and bool(_CRC_RE.match(v["crc32"])) and nonneg_int(v.get("bytes")))


def check_metadata(meta, where: str) -> None:
    """Every field of ``metadata.json`` that loaders read."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: content must be an object")
    field(meta, "version", where, is_int, "an integer")
    field(meta, "iteration", where, nonneg_int, "a non-negative integer")
    field(meta, "consumed_samples", where, nonneg_int, "a non-negative integer", optional=True)
    manifests = field(meta, "manifests", where, lambda v: isinstance(v, dict) and v,
                      "a non-empty object of manifest name -> digest")
    for name, digest in manifests.items():
        if not is_digest(digest):
            raise CheckpointError(f"{where}: field manifests[{name!r}] must be "
                                  f'{{"crc32": 8 hex digits, "bytes": size}}')
    for key in ("config", "layout", "contents"):
        field(meta, key, where, lambda v: isinstance(v, dict), "an object", optional=True)
    field(meta, "scheduler", where, lambda v: isinstance(v, dict), "an object", optional=True)
    field(meta, "optimizer", where, lambda v: isinstance(v, dict), "an object", optional=True)
    check_config(meta.get("config") or {}, where)
    for key, value in (meta.get("contents") or {}).items():
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: field contents.{key} must be true or false")


def check_config(config: dict, where: str) -> None:
    """Each value of the core's config sections has its field's type (a string where an
    integer belongs would fail later, far from the checkpoint)."""

    for section, cls in SECTIONS.items():
        values = config.get(section)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise CheckpointError(f"{where}: field config.{section} must be an object")
        for f in dataclasses.fields(cls):
            if f.name in values and not _fits(values[f.name], str(f.type)):
                raise CheckpointError(f"{where}: field config.{section}.{f.name} must be "
                                      f"{f.type}, got {values[f.name]!r}")


def _fits(value, annotation: str) -> bool:
    if value is None:
        return "None" in annotation
    if annotation.startswith("bool"):
        return isinstance(value, bool)
    if annotation.startswith("int"):
        return is_int(value) and abs(value) < 2**62
    if annotation.startswith("float"):
        return (is_int(value) or isinstance(value, float)) and value == value \
            and abs(value) != float("inf")
    if annotation.startswith("str"):
        return isinstance(value, str)
    if annotation.startswith("list"):
        return isinstance(value, list)
    return True


def check_manifest(manifest, where: str) -> None:
    """A rank manifest: its rank, files with digests, and each tensor's pieces (their file
    names are checked against the directory by the reader)."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: content must be an object")
    field(manifest, "rank", where, nonneg_int, "a non-negative integer")
    files = field(manifest, "files", where, lambda v: isinstance(v, dict), "an object")
    for name, digest in files.items():
        if not is_digest(digest):
            raise CheckpointError(f"{where}: field files[{name!r}] must be "
                                  f'{{"crc32": 8 hex digits, "bytes": size}}')
    tensors = field(manifest, "tensors", where, lambda v: isinstance(v, dict), "an object")
    for logical, rec in tensors.items():
        at = f"tensors[{logical!r}]"
        if not isinstance(rec, dict):
            raise CheckpointError(f"{where}: field {at} must be an object")
        field(rec, "global_shape", where, is_shape, "a list of sizes", f"{at}.global_shape")
        field(rec, "dtype", where, lambda v: isinstance(v, str) and v in TORCH_DTYPES,
              "one of " + ", ".join(TORCH_DTYPES), f"{at}.dtype")
        pieces = field(rec, "pieces", where, lambda v: isinstance(v, list) and len(v) <= 65536,
                       "a list of at most 65536 pieces", f"{at}.pieces")
        rank = len(rec["global_shape"])
        for i, piece in enumerate(pieces):
            p_at = f"{at}.pieces[{i}]"
            if not isinstance(piece, dict):
                raise CheckpointError(f"{where}: field {p_at} must be an object")
            field(piece, "file", where, lambda v: isinstance(v, str), "a file name",
                  f"{p_at}.file")
            if piece["file"] not in files:
                raise CheckpointError(f"{where}: field {p_at}.file {piece['file']!r} is not "
                                      f"listed in the manifest's files")
            field(piece, "key", where, lambda v: isinstance(v, str), "a string", f"{p_at}.key")
            for key in ("offset", "shape"):
                field(piece, key, where, lambda v: is_shape(v) and len(v) == rank,
                      f"a list of {rank} sizes", f"{p_at}.{key}")
    field(manifest, "rng", where, lambda v: isinstance(v, dict), "an object", optional=True)


#: Most cells the pieces of one tensor may cut it into (see :func:`check_tiling`): 16 MB of
#: bookkeeping. plugtron's writers split a tensor along one dimension, so their pieces make at
#: most two cells each; a manifest whose pieces cut across each other beyond this is refused.
MAX_TILING_CELLS = 1 << 22


def check_tiling(logical: str, global_shape: tuple, pieces: list, where: str) -> None:
    """The pieces of one tensor lie inside it and cover every element exactly once.

    In O(n log n + cells), never pairwise: every piece boundary along a dimension is a cut, the
    cuts divide the tensor into a grid of cells, and each piece covers a sub-grid of them
    exactly (its edges are cuts). The pieces tile the tensor exactly once iff each cell is
    painted by one piece, which painting the pieces one by one into the grid checks, naming
    the first pair that overlaps or the first cell left empty."""

    logical = f"{logical!r} (field tensors[{logical!r}].pieces)"

    for p in pieces:
        if any(o + n > g for o, n, g in zip(p.offset, p.shape, global_shape)):
            raise CheckpointError(f"{where}: tensor {logical}: piece at {p.offset} of shape "
                                  f"{p.shape} lies outside the global shape {global_shape}")
    total = sum(volume(p.shape) for p in pieces)
    if total != volume(global_shape):
        raise CheckpointError(f"{where}: tensor {logical}: its pieces hold {total} elements, "
                              f"the global shape {global_shape} has {volume(global_shape)}")
    if not global_shape:
        if len(pieces) != 1:
            raise CheckpointError(f"{where}: scalar tensor {logical} has {len(pieces)} pieces")
        return
    solid = [p for p in pieces if volume(p.shape)]  # empty pieces cover nothing
    cuts = [sorted({0, g} | {p.offset[d] for p in solid} | {p.offset[d] + p.shape[d]
                                                         for p in solid})
            for d, g in enumerate(global_shape)]
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
    if cells > MAX_TILING_CELLS:
        raise CheckpointError(f"{where}: tensor {logical}: its {len(pieces)} pieces cut it "
                              f"into {cells} cells, more than the {MAX_TILING_CELLS} allowed "
                              f"(pieces must split a tensor along few boundaries)")
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    owner = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)  # piece number + 1, 0: none
    for number, p in enumerate(solid, 1):
        box = tuple(slice(index[d][o], index[d][o + n])
                    for d, (o, n) in enumerate(zip(p.offset, p.shape)))
        painted = owner[box]
        taken = painted[painted != 0]
        if taken.size:
            other = solid[int(taken[0]) - 1]
            raise CheckpointError(f"{where}: tensor {logical}: pieces at {other.offset} and "
                                  f"{p.offset} overlap")
        painted[...] = number
    empty = np.argwhere(owner == 0)
    if empty.size:  # not reachable with equal totals and no overlap; kept as a guard
        at = tuple(int(cuts[d][i]) for d, i in enumerate(empty[0]))
        raise CheckpointError(f"{where}: tensor {logical}: no piece covers the element at {at}")
