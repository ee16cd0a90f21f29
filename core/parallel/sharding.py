"""How a parameter is sharded, declared on the parameter itself.

Every layer that creates a parameter says how the full (layout-free) tensor maps onto this rank,
so that grad norms count each element once and checkpoints can store global tensors that load
into any layout. Attributes (absent means "replicated, not sharded"):

* ``tensor_model_parallel`` (bool): sharded over the tensor-parallel group.
* ``partition_dim`` (int): the dimension that is split.
* ``partition_chunks`` (int or tuple of ints): the full tensor is blocks along
  ``partition_dim`` and each block is split across tp separately: an int is that many equal
  blocks (a gated MLP's [gate; up]), a tuple gives each block's full size (for a fused
  projection whose blocks differ in size).
* ``sequence_parallel`` (bool): replicated over tp but fed sequence-sharded activations, so its
  gradient must be all-reduced over tp when grads are finalised.
* ``shared_group`` (str): one copy of a tensor shared between the first and last pipeline stage
  (core/parallel/shared_params.py, e.g. a tied embedding); gradients are summed over the embedding group.
* ``allreduce`` (bool, default True): reduced over data parallel (False for expert params, which
  reduce over the expert data-parallel group). An expert parameter's tensor-parallel split and
  ``sequence_parallel`` sum are over the *expert* tensor-parallel group (etp, which may differ
  from tp): :func:`tp_split_of` says which group a parameter is split over.
* ``fused_parts`` (``(kind, sizes, groups)``, :func:`mark_fused_parts`): a matrix that fuses
  several projections along its rows (a QKV laid out per query group, a gated MLP's [gate; up]); an
  optimizer that treats each matrix as a whole (Muon) treats each part as its own matrix.

A data-parallel wrapper may shard parameters again over data parallelism as DTensors (``fsdp2``);
the functions at the end of this module (:func:`local_tensor`, :func:`full_tensor`,
:func:`shard_like`) let code written for whole tensors handle those too.
"""

from __future__ import annotations

import sys

import torch
from plugtron.core.parallel import comm

#: Imported by whoever makes DTensors (``fsdp2``), not here: it costs about a second at every
#: start, and until it is imported no tensor can be a DTensor.
DTENSOR_MODULE = "torch.distributed.tensor"


def block_sizes(total: int, chunks: int | tuple[int, ...] = 1) -> list[int]:
    """Full size of each block of a dimension of ``total`` elements split as ``chunks``."""
    if isinstance(chunks, int):
        if total % chunks:
            raise ValueError(f"a dimension of {total} does not split into {chunks} equal blocks")
        return [total // chunks] * chunks
    sizes = [int(c) for c in chunks]
    if sum(sizes) != total:
        raise ValueError(f"blocks {sizes} do not add up to the dimension's {total}")
    return sizes


def local_block_sizes(local_total: int, size: int,
                      chunks: int | tuple[int, ...] = 1) -> list[int]:
    """Each block's size in one rank's shard (of ``local_total`` elements) of ``size`` ranks."""
    if isinstance(chunks, int):
        return block_sizes(local_total, chunks)
    return [c // size for c in block_sizes(local_total * size, chunks)]


def set_tensor_parallel(param: torch.nn.Parameter, dim: int,
                        chunks: int | tuple[int, ...] = 1) -> None:
    # Megatron's attribute names on the parameter itself, so code written for Megatron reads them
    setattr(param, "tensor_model_parallel", True)
    setattr(param, "partition_dim", dim)
    setattr(param, "partition_chunks", chunks if isinstance(chunks, int) else tuple(chunks))


def mark_added_by_transform(tensor: torch.Tensor, transform: str) -> None:
    """Declare ``tensor`` new: model transform ``transform`` added it (the builder marks what a
    transform adds), so a checkpoint of the plain model loads without it."""
    setattr(tensor, "added_by_transform", transform)


def added_by_transform(tensor: torch.Tensor) -> str | None:
    """The model transform that added ``tensor``; None for the model's own tensors."""
    return getattr(tensor, "added_by_transform", None)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def is_expert(param: torch.Tensor) -> bool:
    """An expert parameter (``allreduce = False``): split over ep and etp, reduced over edp."""
    return getattr(param, "allreduce", True) is False


def tp_split_of(param: torch.Tensor, parallel) -> tuple:
    """``(group, rank, size)`` of the tensor-parallel group ``param`` lives in: etp for expert
    parameters, tp for the others. Replicas of a non-sharded parameter are the same group."""
    if is_expert(param):
        return parallel.etp_group, parallel.etp_rank, parallel.etp_size
    return parallel.tp_group, parallel.tp_rank, parallel.tp_size


def shard_of(full: torch.Tensor, dim: int, rank: int, size: int,
             chunks: int | tuple[int, ...] = 1) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` (per block when ``chunks`` gives several)."""
    if size == 1:
        return full
    blocks = full.split(block_sizes(full.shape[dim], chunks), dim=dim)
    for block in blocks:
        if block.shape[dim] % size:
            raise ValueError(f"a block of {block.shape[dim]} does not split over {size} ranks")
    if full.is_meta:  # a meta build (memory estimate): only the shape (torch.cat on meta
        shape = list(full.shape)  # would import torch's compiler, seconds)
        shape[dim] //= size
        return torch.empty(shape, dtype=full.dtype, device="meta")
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], dim: int,
            chunks: int | tuple[int, ...] = 1) -> torch.Tensor:
    """Inverse of ``shard_of`` given every rank's shard in rank order."""
    if len(shards) == 1:
        return shards[0]
    local = local_block_sizes(shards[0].shape[dim], len(shards), chunks)
    per_rank = [s.split(local, dim=dim) for s in shards]
    return torch.cat([torch.cat([r[c] for r in per_rank], dim=dim) for c in range(len(local))],
                     dim=dim)


def mark_sequence_parallel(target: torch.nn.Module | torch.nn.Parameter) -> None:
    """Declare one parameter, or every parameter of a module, replicated over tp but fed
    sequence-sharded activations (norms, row-parallel biases under SP): finalize sums their
    grads over tp."""
    params = [target] if isinstance(target, torch.nn.Parameter) else target.parameters()
    for param in params:
        setattr(param, "sequence_parallel", True)  # Megatron's attribute, read by finalize


def gather_tensor_parallel(param: torch.Tensor, tp_group) -> torch.Tensor:
    """The full (tp-unsharded) tensor of ``param``, the same on every rank of ``tp_group``.

    A collective over ``tp_group`` for sharded params (and over the data-parallel mesh of a
    DTensor parameter) (every tp rank must call it, for the same
    params in the same order); replicated params come back as they are.
    """

    # Sharded over data parallelism too (a DTensor): whole over dp first (a collective there).
    return gather_tp_shards(full_tensor(param.detach()), param, tp_group)


def gather_tp_shards(tensor: torch.Tensor, like: torch.Tensor, tp_group) -> torch.Tensor:
    """The full tensor of which ``tensor`` is this rank's tensor-parallel shard, sharded the way
    parameter ``like`` declares (its gradient, an optimizer's update of it); ``tensor`` itself
    when ``like`` is not split. A collective over ``tp_group`` (every rank, same order)."""
    if not is_tensor_parallel(like) or comm.group_size(tp_group) == 1:
        return tensor
    dim, chunks = getattr(like, "partition_dim"), getattr(like, "partition_chunks", 1)
    gathered = comm.all_gather_tensor(tensor, tp_group, dim=dim)
    return unshard(list(gathered.chunk(comm.group_size(tp_group), dim=dim)), dim, chunks)


def mark_fused_parts(param: torch.nn.Parameter, sizes: tuple[int, ...], groups: int = 1,
                     kind: str = "fused") -> None:
    """Declare that matrix ``param`` fuses projections along its rows: the FULL tensor's rows
    are ``groups`` repetitions of blocks of ``sizes`` rows, block ``k`` of every repetition
    belonging to part ``k``. A QKV laid out per query group is ``sizes`` = (queries per group x
    head dim, head dim, head dim) and ``groups`` = the query groups; a gated MLP's [gate; up] is
    ``(ffn, ffn)``. ``kind`` names the fusion (``qkv``, ``gate_up``) so that an optimizer can
    offer a switch per kind."""
    setattr(param, "fused_parts", (str(kind), tuple(int(s) for s in sizes), int(groups)))


def fused_part_rows(param: torch.Tensor, rows: int) -> tuple[str, torch.Tensor] | None:
    """``(kind, part of each row)`` of the full ``rows``-row tensor of a parameter declared with
    :func:`mark_fused_parts` (an int64 tensor of part indices), or None when none is declared.
    ``shard_of`` cuts a tensor-parallel rank's rows out of it like the parameter's."""
    declared = getattr(param, "fused_parts", None)
    if declared is None:
        return None
    kind, sizes, groups = declared
    if groups * sum(sizes) != rows:
        raise ValueError(f"fused parts {sizes} x {groups} groups do not add up to the "
                         f"{rows} rows of the full tensor")
    pattern = torch.cat([torch.full((size,), part, dtype=torch.int64)
                         for part, size in enumerate(sizes)])
    return kind, pattern.repeat(groups)


def full_named_tensors(module: torch.nn.Module, tp_group) -> dict[str, torch.Tensor]:
    """``{name: full tensor}`` for every parameter of ``module`` (a collective over tp)."""
    return {name: gather_tensor_parallel(p, tp_group) for name, p in module.named_parameters()}


# --------------------------------------------------------------------------- dp shards (DTensors)
# Tensors a data-parallel wrapper shards over data parallelism as DTensors (``fsdp2``), seen from
# code written for whole local tensors: the gradient math reads each rank's local shard,
# checkpoints and comparisons gather the whole tensor, loading cuts this rank's shard. Every
# function takes plain tensors too and returns them unchanged, so callers need no branch.


def is_dtensor(tensor) -> bool:
    dtensor = getattr(sys.modules.get(DTENSOR_MODULE), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor):
    """This rank's shard of ``tensor`` (a view: writing into it writes the DTensor)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_tensors(tensors) -> list:
    return [local_tensor(t) for t in tensors]


def full_tensor(tensor):
    """The whole tensor (this rank's tensor-parallel piece, never split over data
    parallelism). A collective over the DTensor's mesh: every rank of it calls it, for the same
    tensors in the same order."""
    if not is_dtensor(tensor):
        return tensor
    return tensor.detach().full_tensor()


def shard_like(full: torch.Tensor, reference):
    """``full`` (a whole tensor) laid out like ``reference``: its DTensor shard when
    ``reference`` is one (cut locally, no communication), else ``full`` itself."""
    if not is_dtensor(reference):
        return full
    from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415 - see DTENSOR_MODULE

    full = full.to(device=reference.device, dtype=reference.dtype)
    return distribute_tensor(full, reference.device_mesh, reference.placements,
                             src_data_rank=None)


def copy_full_into_(target, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` into ``target`` (a DTensor parameter or a plain
    tensor of ``full``'s shape)."""
    with torch.no_grad():
        if is_dtensor(target):
            local_tensor(target).copy_(local_tensor(shard_like(full, target)))
        else:
            target.copy_(full)


#: torch's caches keyed by device meshes: ``(module, attribute path)`` of each ``cache_clear``.
_MESH_CACHES = (
    ("torch.distributed.tensor._api", "DTensor._op_dispatcher.sharding_propagator"
                                      ".propagate_op_sharding"),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator"
                                                "._propagate_tensor_meta_cached"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh"),
)


def forget_meshes() -> None:
    """Drop what DTensor cached about device meshes. Those caches compare meshes by their
    ranks, not their process groups: after the world is destroyed and formed again (a test
    pool, a notebook), a hit would hand back a mesh whose groups died with the old world."""
    for module_name, path in _MESH_CACHES:
        target: object = sys.modules.get(module_name)
        if target is None:  # never imported: nothing cached
            continue
        for part in path.split("."):
            target = getattr(target, part, None)
        clear = getattr(target, "cache_clear", None)
        if clear is not None:
            clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path's own copy of the sharding cache
        native()
