"""The small files of a checkpoint: checked JSON, file digests, atomic writes.

Every JSON file is ``{"sha256": H, "content": C}`` where ``H`` is the SHA-256 of ``C`` in
canonical form (sorted keys, no spaces), so a flipped byte anywhere is caught on read and named.
Tensors inside JSON content (RNG states) are encoded as raw bytes in base64 with dtype and shape;
nothing is ever pickled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zlib

import numpy as np
import torch
from plugtron.core.checkpoint.safe_files import open_regular, read_small, regular_file_size
from plugtron.core.checkpoint.st_header import TORCH_DTYPES, is_shape
from plugtron.core.errors import CheckpointError

_TENSOR_TAG = "__tensor__"


def encode(value):
    """JSON-ready copy of ``value``: tensors become tagged base64 records, tuples lists."""
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        return {_TENSOR_TAG: str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def decode(value, where: str = "checkpoint"):
    """Inverse of :func:`encode`; a malformed tensor record is a ``CheckpointError`` naming
    ``where`` (the file and field)."""
    if isinstance(value, dict):
        if _TENSOR_TAG in value:
            return _decode_tensor(value, where)
        return {k: decode(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _decode_tensor(value: dict, where: str) -> torch.Tensor:

    name, shape, data = value[_TENSOR_TAG], value.get("shape"), value.get("data")
    if not isinstance(name, str) or name not in TORCH_DTYPES or not is_shape(shape) or not isinstance(data, str):
        raise CheckpointError(f"{where}: malformed tensor record (dtype {name!r}, shape "
                              f"{shape!r})")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise CheckpointError(f"{where}: tensor data is not base64") from None
    itemsize = TORCH_DTYPES[name]
    count = max(1, int(np.prod(shape, dtype=np.int64)))
    if len(raw) != count * itemsize:
        raise CheckpointError(f"{where}: tensor data has {len(raw)} bytes, dtype {name} shape "
                              f"{shape} needs {count * itemsize}")
    array = np.frombuffer(raw, dtype=np.uint8).copy()
    return torch.from_numpy(array).view(getattr(torch, name)).reshape(shape)


def _canonical(content) -> bytes:
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str, content) -> None:
    """Write checked JSON (content plus the SHA-256 of its canonical form)."""
    body = {"sha256": hashlib.sha256(_canonical(content)).hexdigest(), "content": content}
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    write_bytes(path, data)


def read_json(path: str):
    """Content of a checked JSON file; ``CheckpointError`` naming the file if it is missing,
    truncated or altered."""
    try:
        body = json.loads(read_small(path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is unreadable or truncated "
                              f"({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict) or "content" not in body or "sha256" not in body:
        raise CheckpointError(f"checkpoint file {path} is not a plugtron checkpoint file")
    if hashlib.sha256(_canonical(body["content"])).hexdigest() != body["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its checksum does not match "
                              f"its content")
    return body["content"]


def file_digest(path: str, chunk: int = 1 << 24) -> dict:
    """``{"crc32": hex, "bytes": size}`` of a file, read in chunks. CRC-32 catches truncation
    and flipped bits (the threat here is damage, not tampering) at several GB/s, which SHA-256
    does not on a CPU without SHA instructions."""
    crc, size = 0, 0
    with open_regular(path) as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"crc32": f"{crc:08x}", "bytes": size}


def verify_file(path: str, expected: dict, where: str = "checkpoint",
                field: str = "files") -> None:
    """``CheckpointError`` naming ``path`` unless it is a regular file (not a link) with the
    recorded size and digest; the size is compared before a byte is read."""
    actual_size = regular_file_size(os.path.dirname(path), os.path.basename(path), where, field)
    if actual_size != expected["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or altered: {actual_size} "
                              f"bytes, expected {expected['bytes']}")
    actual = file_digest(path)["crc32"]
    if actual != expected["crc32"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: CRC-32 {actual} does not "
                              f"match the recorded {expected['crc32']}")
