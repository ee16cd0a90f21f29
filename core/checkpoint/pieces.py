"""Where a rank's shard sits inside the global tensor, and copying between shards of two layouts.

A tensor-parallel shard is not always one box of the global tensor: with ``partition_chunks``
> 1 (a gated MLP's ``[gate; up]``) or a tuple of block sizes (a fused projection of unequal parts) the
global tensor is blocks along the partition dimension and each block is split over the tp ranks separately, so a rank holds one box per
block. A checkpoint stores every box a writer held as a *piece* with its global offset; loading
intersects the boxes the reading rank needs with the stored pieces. Neither side needs to know
the other's layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from plugtron.core.parallel.sharding import block_sizes, is_tensor_parallel


@dataclass(frozen=True)
class Box:
    """A box of the global tensor (``offset``, ``shape``) and where it sits in the local shard
    (``local_offset``)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...]


@dataclass(frozen=True)
class ShardSpec:
    """How a local tensor maps onto its global tensor: split along ``dim`` over ``size`` ranks
    (this one is ``rank``), per block when ``chunks`` > 1 or a tuple of block sizes; ``dim``
    None means replicated."""

    global_shape: tuple[int, ...]
    dim: int | None = None
    chunks: int | tuple[int, ...] = 1
    rank: int = 0
    size: int = 1

    @classmethod
    def of_param(cls, param: torch.Tensor, tp_rank: int, tp_size: int) -> ShardSpec:
        """Read the sharding a layer declared on ``param`` (core/parallel/sharding.py)."""
        shape = tuple(param.shape)
        if not is_tensor_parallel(param) or tp_size == 1:
            return cls(shape)
        dim = int(getattr(param, "partition_dim"))  # declared by the layer (mark_sharded)
        full = list(shape)
        full[dim] *= tp_size
        return cls(tuple(full), dim, getattr(param, "partition_chunks", 1) or 1, tp_rank, tp_size)

    @property
    def sharded(self) -> bool:
        return self.dim is not None and self.size > 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None or not self.sharded:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] //= self.size
        return tuple(shape)

    def boxes(self) -> list[Box]:
        zeros = (0,) * len(self.global_shape)
        d = self.dim
        if d is None or not self.sharded:
            return [Box(zeros, self.global_shape, zeros)]
        total = self.global_shape[d]
        try:
            blocks = block_sizes(total, self.chunks)
        except ValueError as exc:
            raise ValueError(f"dimension {d} of {self.global_shape}: {exc}") from None
        if any(block % self.size for block in blocks):
            raise ValueError(f"dimension {d} of {self.global_shape} does not split into "
                             f"blocks {blocks} x {self.size} ranks")
        out, start, local_start = [], 0, 0
        for block in blocks:
            width = block // self.size
            offset, local, shape = list(zeros), list(zeros), list(self.global_shape)
            offset[d], local[d], shape[d] = start + self.rank * width, local_start, width
            out.append(Box(tuple(offset), tuple(shape), tuple(local)))
            start, local_start = start + block, local_start + width
        return out


def intersect(a_offset, a_shape, b_offset, b_shape):
    """(offset, shape) of the overlap of two boxes, or None."""
    offset, shape = [], []
    for ao, an, bo, bn in zip(a_offset, a_shape, b_offset, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return tuple(offset), tuple(shape)


def region(start, shape) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(start, shape))


def volume(shape) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class Piece:
    """One stored box: safetensors ``key`` in ``file`` holds the global box (offset, shape)."""

    file: str
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


#: read(piece, slices inside the piece) -> tensor of that region
PieceReader = Callable[[Piece, tuple], torch.Tensor]


def fill_shard(target: torch.Tensor, spec: ShardSpec, saved_shape: tuple[int, ...],
               pieces: list[Piece], read: PieceReader) -> tuple[int, int]:
    """Copy into ``target`` (the local shard ``spec`` describes) every stored value it needs.

    Where the saved global shape is smaller than the current one along some dimension (a
    vocabulary padded for a different tp size), only the common part is copied and the rest of
    ``target`` is left alone. Returns (elements copied, elements that should have been copied),
    which differ only if the checkpoint lacks pieces.
    """
    copied = expected = 0
    for box in spec.boxes():
        zeros = (0,) * len(saved_shape)
        wanted = intersect(box.offset, box.shape, zeros, saved_shape)
        if wanted is None:
            continue
        expected += volume(wanted[1])
        for piece in pieces:
            common = intersect(wanted[0], wanted[1], piece.offset, piece.shape)
            if common is None:
                continue
            offset, shape = common
            in_piece = tuple(o - p for o, p in zip(offset, piece.offset))
            in_target = tuple(o - b + lo for o, b, lo in zip(offset, box.offset, box.local_offset))
            values = read(piece, region(in_piece, shape))
            with torch.no_grad():
                target[region(in_target, shape)].copy_(values)
            copied += volume(shape)
    return copied, expected


def local_boxes_of(tensor: torch.Tensor, spec: ShardSpec) -> list[tuple[Box, torch.Tensor]]:
    """Each box of ``spec`` with the (contiguous) part of ``tensor`` that holds it."""
    if tuple(tensor.shape) != spec.local_shape:
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} is not the local shard "
                         f"{spec.local_shape} of {spec.global_shape}")
    return [(box, tensor[region(box.local_offset, box.shape)]) for box in spec.boxes()]
