"""A checkpoint described for people (``plugtron checkpoint inspect``)."""

from __future__ import annotations

from plugtron.core.checkpoint.reader import CheckpointReader


def describe(path: str) -> dict:
    """Iteration, layout, config, plugins and every tensor's global shape, dtype and pieces."""
    reader = CheckpointReader(path)
    meta = reader.metadata
    tensors = {}
    stored_bytes = 0
    for name in sorted(reader.tensors):
        rec = reader.tensors[name]
        tensors[name] = {"shape": list(rec.global_shape), "dtype": rec.dtype,
                         "pieces": len(rec.pieces)}
    for digest in reader.file_digests.values():
        stored_bytes += digest["bytes"]
    return {"path": reader.path, "iteration": meta["iteration"],
            "consumed_samples": meta.get("consumed_samples"), "layout": meta.get("layout"),
            "contents": meta.get("contents"), "plugins": meta.get("plugins"),
            "plugtron_version": meta.get("plugtron_version"), "saved_at": meta.get("saved_at"),
            "source": meta.get("source"), "tensor_bytes": stored_bytes,
            "config": meta.get("config"), "tensors": tensors}
