"""Editing a checkpoint's JSON files the way an attacker would, keeping the checksums valid
(so the reader's structural checks, not the digests, have to catch the problem)."""

from __future__ import annotations

import os

from plugtron.core.checkpoint import jsonio

MANIFEST = "rank_00000.json"
MODEL = "model_rank_00000.safetensors"
OPTIM = "optim_rank_00000.safetensors"


def edit_manifest(ckpt: str, edit, name: str = MANIFEST) -> None:
    """``edit(content)`` mutates the manifest (or returns a replacement); digests follow."""
    path = os.path.join(ckpt, name)
    content = jsonio.read_json(path)
    result = edit(content)
    content = content if result is None else result
    jsonio.write_json(path, content)
    refresh_metadata(ckpt)


def refresh_metadata(ckpt: str, edit=None) -> None:
    path = os.path.join(ckpt, "metadata.json")
    meta = jsonio.read_json(path)
    if isinstance(meta.get("manifests"), dict):
        for name in list(meta["manifests"]):
            file = os.path.join(ckpt, name)
            if os.path.isfile(file):
                meta["manifests"][name] = jsonio.file_digest(file)
    if edit is not None:
        meta = edit(meta) or meta
    jsonio.write_json(path, meta)


def rename_file(content: dict, old: str, new: str, digest: dict | None = None) -> None:
    """Point the manifest's file entry ``old`` (and every piece in it) at ``new``."""
    entry = content["files"].pop(old)
    content["files"][new] = digest or entry
    for rec in content["tensors"].values():
        for piece in rec["pieces"]:
            if piece["file"] == old:
                piece["file"] = new


def first_tensor(content: dict, prefix: str = "model/") -> dict:
    return next(rec for name, rec in sorted(content["tensors"].items())
                if name.startswith(prefix) and len(rec["global_shape"]) == 2)
