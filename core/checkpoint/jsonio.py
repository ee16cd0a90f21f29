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

from ..errors import CheckpointError

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


def decode(value):
    """Inverse of :func:`encode`."""
    if isinstance(value, dict):
        if _TENSOR_TAG in value:
            dtype = getattr(torch, value[_TENSOR_TAG])
            raw = np.frombuffer(base64.b64decode(value["data"]), dtype=np.uint8).copy()
            return torch.from_numpy(raw).view(dtype).reshape(value["shape"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


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
        with open(path, "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
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
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"crc32": f"{crc:08x}", "bytes": size}


def verify_file(path: str, expected: dict) -> None:
    """``CheckpointError`` naming ``path`` unless it has the recorded size and digest."""
    try:
        actual_size = os.path.getsize(path)
    except OSError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    if actual_size != expected["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or altered: {actual_size} "
                              f"bytes, expected {expected['bytes']}")
    actual = file_digest(path)["crc32"]
    if actual != expected["crc32"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: CRC-32 {actual} does not "
                              f"match the recorded {expected['crc32']}")
