"""Reading a checkpoint: metadata, manifests and tensor pieces, each verified before use.

Files are checked against the digests recorded when they were written (the manifests against
``metadata.json``, the tensor files against their manifest) the first time they are read, so a
truncated or altered file gives a :class:`CheckpointError` naming it instead of an error deep in
torch. Tensor files are read through safetensors slices: a rank reads only the parts it needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from . import jsonio, layout
from .pieces import Piece, ShardSpec, fill_shard

FORMAT = "plugtron-checkpoint"
VERSION = 1


@dataclass
class TensorRecord:
    global_shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece]


class CheckpointReader:
    """One checkpoint directory, opened for reading."""

    def __init__(self, path: str):
        self.path = layout.resolve_load_path(path)
        self.metadata = jsonio.read_json(os.path.join(self.path, layout.METADATA))
        if self.metadata.get("format") != FORMAT:
            raise CheckpointError(f"{self.path} is not a plugtron checkpoint "
                                  f"(format {self.metadata.get('format')!r})")
        if self.metadata.get("version", 0) > VERSION:
            raise CheckpointError(f"{self.path} has checkpoint format version "
                                  f"{self.metadata['version']}; this plugtron reads up to "
                                  f"{VERSION}")
        self.manifests: dict[int, dict] = {}
        self.file_digests: dict[str, dict] = {}
        self.tensors: dict[str, TensorRecord] = {}
        for name, digest in sorted(self.metadata["manifests"].items()):
            file = os.path.join(self.path, name)
            jsonio.verify_file(file, digest)
            manifest = jsonio.read_json(file)
            self.manifests[int(manifest["rank"])] = manifest
            self.file_digests.update(manifest["files"])
            for logical, rec in manifest["tensors"].items():
                pieces = [Piece(p["file"], p["key"], tuple(p["offset"]), tuple(p["shape"]))
                          for p in rec["pieces"]]
                known = self.tensors.get(logical)
                if known is None:
                    self.tensors[logical] = TensorRecord(tuple(rec["global_shape"]),
                                                         rec["dtype"], pieces)
                else:
                    known.pieces.extend(pieces)
        self._verified: set[str] = set()
        self._handles: dict[str, object] = {}

    # ------------------------------------------------------------------ metadata views
    @property
    def iteration(self) -> int:
        return int(self.metadata["iteration"])

    @property
    def config(self) -> dict:
        return self.metadata["config"]

    def names(self, prefix: str) -> list[str]:
        return sorted(n[len(prefix):] for n in self.tensors if n.startswith(prefix))

    def rng_state(self, rank: int):
        manifest = self.manifests.get(rank)
        if manifest is None or manifest.get("rng") is None:
            return None
        return jsonio.decode(manifest["rng"])

    # ------------------------------------------------------------------ tensor data
    def _open(self, file: str):
        handle = self._handles.get(file)
        if handle is not None:
            return handle
        path = os.path.join(self.path, file)
        digest = self.file_digests.get(file)
        if digest is None:
            raise CheckpointError(f"checkpoint file {path} is not listed in any manifest")
        if file not in self._verified:
            jsonio.verify_file(path, digest)
            self._verified.add(file)
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from None
        self._handles[file] = handle
        return handle

    def _read_piece(self, piece: Piece, slices: tuple) -> torch.Tensor:
        try:
            return self._open(piece.file).get_slice(piece.key)[slices]
        except SafetensorError as exc:
            raise CheckpointError(f"checkpoint file {os.path.join(self.path, piece.file)}: "
                                  f"tensor {piece.key!r} cannot be read: {exc}") from None

    def record(self, logical: str) -> TensorRecord:
        rec = self.tensors.get(logical)
        if rec is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {logical!r}")
        return rec

    def read_into(self, logical: str, target: torch.Tensor, spec: ShardSpec) -> None:
        """Fill ``target`` (the local shard ``spec`` describes) from the stored pieces."""
        rec = self.record(logical)
        copied, expected = fill_shard(target, spec, rec.global_shape, rec.pieces,
                                      self._read_piece)
        if copied != expected:
            raise CheckpointError(f"checkpoint {self.path}: tensor {logical!r} is incomplete "
                                  f"({copied} of {expected} needed elements stored)")

    def read_full(self, logical: str) -> torch.Tensor:
        """The whole global tensor."""
        rec = self.record(logical)
        out = torch.empty(rec.global_shape, dtype=getattr(torch, rec.dtype))
        self.read_into(logical, out, ShardSpec(rec.global_shape))
        return out

    def close(self) -> None:
        self._handles.clear()
