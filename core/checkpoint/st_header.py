"""The header of a safetensors file, parsed and checked against the file's size before any
tensor is read.

Format: 8 bytes little-endian header length N, N bytes of JSON ``{key: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data. Each tensor's byte range
must lie inside the data and have exactly ``prod(shape) x itemsize`` bytes, so whatever is
allocated from a header is bounded by the file's size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TypeGuard

from plugtron.core.checkpoint.safe_files import open_regular
from plugtron.core.errors import CheckpointError

#: safetensors dtype -> (torch dtype name, bytes per element)
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
          "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4),
          "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1)}
TORCH_DTYPES = {name: size for name, size in DTYPES.values()}
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str  # torch name, e.g. "float32"
    shape: tuple[int, ...]
    nbytes: int


def is_shape(value) -> TypeGuard[list[int]]:
    return (isinstance(value, (list, tuple)) and len(value) <= 64
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value))


def read_header(path: str) -> dict[str, HeaderEntry]:
    """``{key: HeaderEntry}`` of a safetensors file; ``CheckpointError`` naming the file and
    the field for anything malformed."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"safetensors file {path} is truncated ({size} bytes)")
        length = int.from_bytes(head, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"safetensors file {path}: header length {length} does not "
                                  f"fit the file ({size} bytes)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"safetensors file {path}: the header is not JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"safetensors file {path}: the header is not a JSON object")
    data_bytes = size - 8 - length
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        where = f"safetensors file {path}: tensor {key!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where} is not an object")
        name = entry.get("dtype")
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise CheckpointError(f"{where}: field dtype {entry.get('dtype')!r} is not one of "
                                  f"{', '.join(DTYPES)}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not is_shape(shape):
            raise CheckpointError(f"{where}: field shape {shape!r} is not a list of sizes")
        if not (is_shape(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]
                <= data_bytes):
            raise CheckpointError(f"{where}: field data_offsets {offsets!r} is not a byte range "
                                  f"inside the file's {data_bytes} data bytes")
        nbytes = math.prod(shape) * dtype[1]
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(f"{where}: field data_offsets spans {offsets[1] - offsets[0]} "
                                  f"bytes but shape {shape} of {entry['dtype']} needs {nbytes}")
        out[key] = HeaderEntry(dtype[0], tuple(shape), nbytes)
    return out
