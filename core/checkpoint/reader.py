"""Reading a checkpoint: metadata, manifests and tensor pieces, each verified before use.

Files are checked against the digests recorded when they were written (the manifests against
``metadata.json``, the tensor files against their manifest) the first time they are read, so a
truncated or altered file gives a :class:`CheckpointError` naming it instead of an error deep in
torch. Tensor files are read through safetensors slices: a rank reads only the parts it needs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from plugtron.core.checkpoint import jsonio, layout, schema
from plugtron.core.checkpoint.pieces import Piece, ShardSpec, fill_shard
from plugtron.core.checkpoint.safe_files import check_plain_name, regular_file_size
from plugtron.core.checkpoint.st_header import read_header
from plugtron.core.errors import CheckpointError
from safetensors import SafetensorError, safe_open

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
        explicit, candidates = layout.load_candidates(path)
        if explicit:
            self._open(candidates[0])
            return
        # A directory of checkpoints: the newest one that is complete and valid, every file
        # checked against its CRC; a bad one is skipped with a warning naming it.
        for i, candidate in enumerate(candidates):
            try:
                self._open(candidate)
                self.verify_all()
                return
            except CheckpointError as exc:
                if i == len(candidates) - 1:
                    raise
                if int(os.environ.get("RANK", 0)) == 0:
                    print(f"warning: skipping checkpoint {candidate}: {exc}; trying the "
                          f"previous one", file=sys.stderr, flush=True)

    def verify_all(self) -> None:
        """Every tensor file against the CRC-32 its manifest recorded."""
        for name, digest in self.file_digests.items():
            if name not in self._verified:
                jsonio.verify_file(os.path.join(self.path, name), digest)
                self._verified.add(name)

    def _open(self, path: str) -> None:
        self._owner: dict[str, str] = {}  # tensor file -> the manifest that lists it
        self._where: dict[str, str] = {}  # logical tensor -> the manifest that declared it
        self._verified: set[str] = set()
        self.path = path
        meta_path = os.path.join(self.path, layout.METADATA)
        regular_file_size(self.path, layout.METADATA, self.path, layout.METADATA)
        self.metadata = jsonio.read_json(meta_path)
        if not isinstance(self.metadata, dict) or self.metadata.get("format") != FORMAT:
            found = self.metadata.get("format") if isinstance(self.metadata, dict) else None
            raise CheckpointError(f"{meta_path}: field format is {found!r}, not {FORMAT!r}: "
                                  f"{self.path} is not a plugtron checkpoint")
        schema.check_metadata(self.metadata, meta_path)
        if self.metadata["version"] > VERSION:
            raise CheckpointError(f"{self.path} has checkpoint format version "
                                  f"{self.metadata['version']}; this plugtron reads up to "
                                  f"{VERSION}")
        self.manifests: dict[int, dict] = {}
        self.file_digests: dict[str, dict] = {}
        self.tensors: dict[str, TensorRecord] = {}
        for name, digest in sorted(self.metadata["manifests"].items()):
            self._read_manifest(name, digest, meta_path)
        self._check_tensors()
        self._handles: dict[str, object] = {}

    def _read_manifest(self, name: str, digest: dict, meta_path: str) -> None:
        check_plain_name(name, meta_path, f"manifests[{name!r}]")
        file = os.path.join(self.path, name)
        jsonio.verify_file(file, digest, meta_path, f"manifests[{name!r}]")
        manifest = jsonio.read_json(file)
        schema.check_manifest(manifest, file)
        rank = manifest["rank"]
        if rank in self.manifests:
            raise CheckpointError(f"{file}: field rank {rank} is claimed by two manifests")
        self.manifests[rank] = manifest
        if manifest.get("rng") is not None:  # its tensor records, checked now, used on resume
            jsonio.decode(manifest["rng"], f"{file}: field rng")
        for fname, fdigest in manifest["files"].items():
            check_plain_name(fname, file, f"files[{fname!r}]")
            if fname in self.file_digests or fname in self.metadata["manifests"]:
                raise CheckpointError(f"{file}: field files[{fname!r}] is listed by another "
                                      f"manifest too")
            size = regular_file_size(self.path, fname, file, f"files[{fname!r}]")
            if size != fdigest["bytes"]:
                raise CheckpointError(f"checkpoint file {os.path.join(self.path, fname)} is "
                                      f"truncated or altered: {size} bytes, expected "
                                      f"{fdigest['bytes']}")
            self.file_digests[fname] = fdigest
            self._owner[fname] = file
        for logical, rec in manifest["tensors"].items():
            pieces = [Piece(p["file"], p["key"], tuple(p["offset"]), tuple(p["shape"]))
                      for p in rec["pieces"]]
            known = self.tensors.get(logical)
            if known is None:
                self.tensors[logical] = TensorRecord(tuple(rec["global_shape"]), rec["dtype"],
                                                     pieces)
                self._where[logical] = file
            elif known.global_shape != tuple(rec["global_shape"]) or known.dtype != rec["dtype"]:
                raise CheckpointError(f"{file}: field tensors[{logical!r}] has global shape "
                                      f"{rec['global_shape']} {rec['dtype']}, another manifest "
                                      f"{list(known.global_shape)} {known.dtype}")
            else:
                known.pieces.extend(pieces)

    def _check_tensors(self) -> None:
        """Every piece against its file's safetensors header (key, dtype, shape), and the
        pieces of each tensor tile it exactly once; nothing is read or allocated before."""
        headers = {}
        backing: dict[tuple[str, str], str] = {}  # (file, key) -> the tensor it is a piece of
        for logical, rec in self.tensors.items():
            where = self._where[logical]
            for piece in rec.pieces:
                # One stored tensor backs one piece: plugtron never writes a key twice, and a
                # key reused would let one stored block stand for several parts of a tensor.
                user = backing.get((piece.file, piece.key))
                if user is not None:
                    raise CheckpointError(f"{where}: tensor {logical!r}: key {piece.key!r} of "
                                          f"{piece.file} backs more than one piece (one of "
                                          f"them of {user!r})")
                backing[(piece.file, piece.key)] = logical
                if piece.file not in headers:
                    headers[piece.file] = read_header(os.path.join(self.path, piece.file))
                entry = headers[piece.file].get(piece.key)
                st = f"safetensors file {os.path.join(self.path, piece.file)}"
                if entry is None:
                    raise CheckpointError(f"{where}: tensor {logical!r}: key {piece.key!r} is "
                                          f"not in {st}")
                if entry.dtype != rec.dtype:
                    raise CheckpointError(f"{where}: field tensors[{logical!r}].dtype "
                                          f"{rec.dtype!r} differs from {st}, which stores "
                                          f"{piece.key!r} as {entry.dtype}")
                if entry.shape != piece.shape:
                    raise CheckpointError(f"{where}: tensor {logical!r}: piece shape "
                                          f"{list(piece.shape)} differs from {st}, which stores "
                                          f"{piece.key!r} with shape {list(entry.shape)}")
            schema.check_tiling(logical, rec.global_shape, rec.pieces, where)

    # ------------------------------------------------------------------ metadata views
    @property
    def iteration(self) -> int:
        return self.metadata["iteration"]

    @property
    def metadata_path(self) -> str:
        return os.path.join(self.path, layout.METADATA)

    def manifest_path(self, rank: int) -> str:
        return os.path.join(self.path, layout.manifest_name(rank))

    @property
    def config(self) -> dict:
        return self.metadata.get("config") or {}

    def names(self, prefix: str) -> list[str]:
        return sorted(n[len(prefix):] for n in self.tensors if n.startswith(prefix))

    def rng_state(self, rank: int):
        manifest = self.manifests.get(rank)
        if manifest is None or manifest.get("rng") is None:
            return None
        return jsonio.decode(manifest["rng"],
                             f"{os.path.join(self.path, layout.manifest_name(rank))}: field rng")

    # ------------------------------------------------------------------ tensor data
    def _handle(self, file: str):
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
            return self._handle(piece.file).get_slice(piece.key)[slices]
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
