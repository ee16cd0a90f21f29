"""One LoRA adapter beside one tensor-parallel linear of the layer backend, sharded to match it
(as Megatron-Bridge shards its ``ParallelLinearAdapter``).

``y = base(x) + alpha / r * B(A(dropout(x)))`` with ``A`` ``[r, in]`` and ``B`` ``[out, r]``:

* beside a **column-parallel** base (output split over tp): ``A`` is split over its rank
  ``r`` and its output gathered, ``B`` is split over the output like the base's weight (block
  by block for a fused ``[gate; up]``), so each rank adds to exactly its own output features;
  under sequence parallelism the input is gathered along the sequence first, as the base does;
* beside a **row-parallel** base (input split over tp): ``A`` is split over the input and its
  partial outputs summed over tp, ``B`` is split over the output and gathered, so every rank
  adds the whole adapter output, scattered along the sequence under sequence parallelism as
  the base's output is.

Every collective is one of ``plugtron.api``'s autograd-aware ones, so the gradients are those
of one process. ``B`` starts at zero, so the adapted model starts as the base model.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from plugtron.api import (
    ConfigError,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    linear,
    normal_init,
    reduce_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
    set_tensor_parallel,
    shard_of,
)

COLUMN, ROW = "column", "row"


def parallel_kind(module: torch.nn.Module) -> str | None:
    """``"column"`` or ``"row"`` for a layer backend's tensor-parallel linear (its weight
    declares the split, ``set_tensor_parallel``), else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2 \
            or not getattr(weight, "tensor_model_parallel", False):
        return None
    dim = getattr(weight, "partition_dim", None)
    return COLUMN if dim == 0 else ROW if dim == 1 else None


class _Weight(torch.nn.Module):
    """Holds one adapter matrix as ``weight`` (names read ``adapter.linear_in.weight``)."""

    def __init__(self, weight: torch.Tensor, dim: int, chunks=1):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        set_tensor_parallel(self.weight, dim, chunks)


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of one linear: ``linear_in`` is A, ``linear_out`` is B."""

    def __init__(self, base: torch.nn.Module, name: str, kind: str, *, rank: int, alpha: float,
                 dropout: float, seed: int, layer_backend, parallel,
                 part: tuple[str, int] | None = None):
        """``part``: ``(its name, its output features)``: the adapter of one projection of a
        fused column-parallel ``base`` (canonical LoRA, lora_split.py), named
        ``<name>.adapter.adapter_<part>``."""
        super().__init__()
        weight = base.weight
        assert isinstance(weight, torch.nn.Parameter)  # parallel_kind found it
        tp, tp_rank = parallel.tp_size, parallel.tp_rank
        local_out, local_in = weight.shape
        column = kind == COLUMN
        expert = getattr(weight, "allreduce", True) is False
        in_features = local_in if column else local_in * tp
        out_features = local_out * tp if column else local_out
        prefix = f"{name}.adapter"
        if part is not None:
            prefix, out_features = f"{prefix}.adapter_{part[0]}", part[1]
        if column and rank % tp:
            raise ConfigError(f"--lora-rank {rank}: the adapter of column-parallel {name} splits "
                              f"its rank over tp {tp}; give a multiple of {tp}")
        if not column and out_features % tp:
            raise ConfigError(f"LoRA on row-parallel {name}: its output of {out_features} does "
                              f"not split over tp {tp}")
        # A: Xavier-normal (Megatron-Bridge's default), drawn whole by its global name
        a_key = f"{prefix}.linear_in.weight"
        a_full = normal_init(math.sqrt(2.0 / (in_features + rank)), seed, a_key)((rank,
                                                                                 in_features))
        a_dim = 0 if column else 1
        self.linear_in = _Weight(shard_of(a_full, a_dim, tp_rank, tp), a_dim)
        chunks = getattr(weight, "partition_chunks", 1) if column and part is None else 1
        b_full = torch.zeros((out_features, rank))
        self.linear_out = _Weight(shard_of(b_full, 0, tp_rank, tp, chunks), 0, chunks)
        self.column, self.chunks = column, chunks
        self.scale = alpha / rank
        self.dropout = dropout
        # An expert's tokens are not split along the sequence (the dispatcher gathered them)
        self.sequence_parallel = not expert and bool(getattr(layer_backend,
                                                             "sequence_parallel", False))
        # The input differs across tp ranks (feature- or sequence-sharded): dropout draws from
        # the model-parallel stream; replicated input needs the same mask on every rank.
        # An expert's adapter runs inside the experts' own (expert-parallel) RNG stream.
        self._dropout_rng = layer_backend.dropout_rng if (
            not expert and (not column or self.sequence_parallel)) else contextlib.nullcontext
        self._parallel = parallel
        if expert:  # an expert's parameter: split over ep, gradients reduced over edp
            for param in self.parameters():
                setattr(param, "allreduce", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._parallel.tp_group
        if self.dropout > 0 and self.training:
            with self._dropout_rng():
                x = F.dropout(x, self.dropout, training=True)
        if self.column:
            x = (gather_from_sequence_parallel_region(x, group) if self.sequence_parallel
                 else copy_to_tensor_parallel_region(x, group))
            low = gather_from_tensor_parallel_region(linear(x, self.linear_in.weight), group)
            # every rank's B reads all of A's output: its gradient is summed over tp
            low = copy_to_tensor_parallel_region(low, group)
            return linear(low, self.linear_out.weight) * self.scale
        low = reduce_from_tensor_parallel_region(linear(x, self.linear_in.weight), group)
        low = copy_to_tensor_parallel_region(low, group)
        out = gather_from_tensor_parallel_region(linear(low, self.linear_out.weight), group)
        if self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out, group)
        return out * self.scale


def _add_adapter_output(module: torch.nn.Module, args: tuple, output):
    """Forward hook of an adapted linear: its ``(output, bias)`` plus the adapter's output."""
    out, bias = output
    adapter = module.adapter
    assert isinstance(adapter, torch.nn.Module)
    return out + adapter(args[0]), bias


def attach_adapter(base: torch.nn.Module, name: str, kind: str, split=None,
                   **options) -> torch.nn.Module:
    """Give ``base`` (module ``name`` of the chunk) an adapter as its child ``adapter`` and add
    its output to every forward; the base keeps its own parameters and their names. ``split``:
    build the adapter with it instead (canonical LoRA's per-projection adapters)."""
    if kind == COLUMN and getattr(base, "gather_output", False):
        raise ConfigError(f"LoRA on {name}: a column-parallel linear that gathers its output is "
                          f"not supported")
    if kind == ROW and getattr(base, "input_is_parallel", True) is False:
        raise ConfigError(f"LoRA on {name}: a row-parallel linear that scatters its input is "
                          f"not supported")
    base.adapter = (split or LoRAAdapter)(base, name, kind, **options)
    base.register_forward_hook(_add_adapter_output)
    return base.adapter
