"""What Muon orthogonalizes: whole matrices under tensor parallelism, and each part of a fused
projection on its own.

Under fsdp2 the update is a DTensor sharded over data parallelism: its rank's (tensor-parallel)
matrix is gathered whole first and this data-parallel rank's shard of the result kept, a
gather per matrix and step that the layer-wise mode (ddp) does without.

A tensor-parallel rank holds a shard of each matrix. ``--muon-tp-mode duplicated`` (the
default) gathers the whole matrix over the parameter's tensor-parallel group (etp for experts),
orthogonalizes it on every rank alike and keeps this rank's shard: the update is the single
process's. ``distributed`` gets the same update without the gather: the iteration runs on the
shards, its Gram matrices summed over the group (newton_schulz.py). ``blockwise`` orthogonalizes each shard alone, with no communication: another
update, which changes with the tp size (Megatron-Core's stated approximation).

A layer that fuses projections into one weight declares its parts (``plugtron.api.
mark_fused_parts``: a QKV per query group, SwiGLU's [gate; up]); each part, its rows gathered
from every group, is orthogonalized and scaled as a matrix of its own when the option of its
kind says so (``--muon-split-qkv``, on by default; ``--muon-split-gate-up``).
"""

from __future__ import annotations

import torch
from plugtron.api import (
    full_tensor,
    fused_part_rows,
    gather_tp_shards,
    is_dtensor,
    is_tensor_parallel,
    shard_like,
    shard_of,
    tp_split_of,
)

from .newton_schulz import (
    PRECISIONS,
    matmul_precision,
    newton_schulz,
    newton_schulz_sharded,
    scale_factor,
    schedule,
)


class Orthogonalizer:
    """``orthogonalizer(param, update)``: the scaled, orthogonalized ``update`` of matrix
    ``param`` (this rank's shard of both), fp32, for the torch optimizer to step with."""

    def __init__(self, options, parallel):
        self.parallel = parallel
        self.coefficients = schedule(options.muon_coefficient_type, options.muon_num_ns_steps)
        self.precision = options.muon_fp32_matmul_prec
        self.dtype = PRECISIONS[self.precision]
        self.scale_mode = options.muon_scale_mode
        self.extra_scale = options.muon_extra_scale_factor
        self.tp_mode = options.muon_tp_mode
        self.split = {"qkv": options.muon_split_qkv, "gate_up": options.muon_split_gate_up}

    def __call__(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        if is_dtensor(update):  # fsdp2's shard over dp: gather the rank's matrix, cut it again
            return shard_like(self._tp_local(param, full_tensor(update)), update)
        return self._tp_local(param, update)

    def _tp_local(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The orthogonalized update of this tensor-parallel rank's piece of ``param``."""
        group, rank, size = tp_split_of(param, self.parallel)
        if not (is_tensor_parallel(param) and size > 1):
            return self._orthogonalize(update, self._parts(param, update.size(0)))
        dim = getattr(param, "partition_dim")
        chunks = getattr(param, "partition_chunks", 1)
        if self.tp_mode == "duplicated":  # the whole matrix, the same on every rank of the group
            whole = gather_tp_shards(update, param, group)
            out = self._orthogonalize(whole, self._parts(param, whole.size(0)))
            return shard_of(out, dim, rank, size, chunks)
        # distributed and blockwise: this shard's rows of each part (all of them when the
        # split is across columns)
        if dim != 0:
            parts = self._parts(param, update.size(0))
        else:
            parts = self._parts(param, update.size(0) * size)
            parts = None if parts is None else shard_of(parts, 0, rank, size, chunks)
        if self.tp_mode == "distributed":  # each part's iteration over the group's shards
            return self._orthogonalize(update, parts, (group, dim, size))
        return self._orthogonalize(update, parts)

    def _parts(self, param: torch.Tensor, rows: int) -> torch.Tensor | None:
        """The part of each row of the full matrix, when the parts are orthogonalized apart."""
        declared = fused_part_rows(param, rows)
        if declared is None or not self.split.get(declared[0], True):
            return None
        return declared[1]

    def _orthogonalize(self, matrix: torch.Tensor, parts: torch.Tensor | None,
                       sharded: tuple | None = None) -> torch.Tensor:
        """``sharded``: ``(group, dim, size)`` when ``matrix`` is a shard of a matrix split
        along ``dim`` over ``group`` (``distributed``), None when it is the whole matrix."""
        if parts is None:
            return self._scaled(matrix, sharded)
        out = torch.empty(matrix.shape, dtype=torch.float32, device=matrix.device)
        for part in torch.unique(parts).tolist():
            rows = (parts == part).nonzero().squeeze(1).to(matrix.device)
            out[rows] = self._scaled(matrix[rows], sharded)
        return out

    def _scaled(self, matrix: torch.Tensor, sharded: tuple | None = None) -> torch.Tensor:
        shape = list(matrix.shape)
        if sharded is not None:  # the scale of the whole matrix
            shape[sharded[1]] *= sharded[2]
        scale = scale_factor(shape[0], shape[1], self.scale_mode) * self.extra_scale
        with matmul_precision(self.precision):
            if sharded is None:
                out = newton_schulz(matrix, self.coefficients, self.dtype)
            else:
                group, dim, _ = sharded
                out = newton_schulz_sharded(matrix, self.coefficients, self.dtype, dim, group)
            return out.float() * scale
