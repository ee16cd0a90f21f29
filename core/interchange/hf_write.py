"""Writing Hugging Face weight files tensor by tensor.

``safetensors.save_file`` serialises every tensor before writing, which would hold the model a
second time. Here the header is computed from shapes and dtypes alone, then each tensor is cast,
written and dropped in turn (the caller's dict is emptied as it goes), so an export holds at
most the converter's output plus one tensor. Shards follow transformers' rules: tensors in
order, a new shard when the next tensor would pass ``max_shard_size`` (a tensor bigger than
that gets a shard of its own), ``model.safetensors`` when one shard holds everything, else
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import re

import torch
from plugtron.core.errors import ConfigError

#: transformers 5's default of ``save_pretrained(max_shard_size=...)``.
DEFAULT_MAX_SHARD_SIZE = "50GB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def parse_size(text) -> int:
    """``"5GB"`` -> 5e9 bytes, ``"500MiB"`` -> 500 * 2**20, an integer -> bytes (as
    transformers reads ``max_shard_size``)."""
    if isinstance(text, int) and text > 0:
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS or int(match.group(1)) < 1:
        raise ConfigError(f"--max-shard-size {text!r} is not a size; use a positive integer "
                          f"and a unit, e.g. 5GB, 500MB or 2GiB")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def _nbytes(tensor: torch.Tensor, dtype) -> int:
    return tensor.numel() * (dtype or tensor.dtype).itemsize


def plan_shards(tensors: dict, dtype, max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        n = _nbytes(tensor, dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write_file(file: str, names: list[str], tensors: dict, dtype) -> None:
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        kind = dtype or t.dtype
        if kind not in _DTYPES:
            raise ConfigError(f"tensor {name} has dtype {kind}, which safetensors does not store")
        n = _nbytes(t, dtype)
        header[name] = {"dtype": _DTYPES[kind], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            t = tensors.pop(name).detach().to("cpu")
            if dtype is not None:
                t = t.to(dtype)
            t = t.contiguous().reshape(-1)
            if t.numel():
                f.write(t.view(torch.uint8).numpy().data)
            del t


def write_weights(out_dir: str, tensors: dict, dtype=None,
                  max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write ``tensors`` (emptied as it goes) as safetensors shards under ``out_dir``; returns
    the file names written."""
    shards = plan_shards(tensors, dtype, parse_size(max_shard_size))
    if len(shards) == 1:
        _write_file(os.path.join(out_dir, "model.safetensors"), shards[0], tensors, dtype)
        return ["model.safetensors"]
    total = sum(_nbytes(t, dtype) for t in tensors.values())
    files, weight_map = [], {}
    for i, names in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        weight_map.update({n: name for n in names})
        _write_file(os.path.join(out_dir, name), names, tensors, dtype)
        files.append(name)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                  sort_keys=True)
    return files + ["model.safetensors.index.json"]
