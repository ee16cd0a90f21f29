"""What a sharding optimizer sees of the data-parallel wrapper: this rank's shard of each bucket.

When the run's optimizer answers hook ``optimizer_shards_gradients`` with yes,
:class:`~plugtron.core.parallel.ddp.DistributedDataParallel` pads every gradient bucket so that the
data-parallel ranks own equal, contiguous shards of it (shards ignore parameter boundaries), and
after ``finish_grad_sync`` rank ``r`` holds the summed gradient of its shard only. Parameters
live in a flat buffer laid out the same way. ``DistributedDataParallel.optimizer_shards()``
describes that layout with the dataclasses below, which is all a ZeRO-1 optimizer needs: it
steps the elements of its shards, writes them into :attr:`ParamShard.data`, and calls the
wrapper's ``start_param_sync()`` so that every rank gets them. No plugin reads the wrapper's
buffers or buckets, so their layout can change without breaking one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from plugtron.core.parallel.grad_buffer import Bucket


@dataclass(frozen=True)
class ParamShard:
    """The elements of one parameter that fall in this rank's shard of one bucket."""

    #: The model parameter.
    param: torch.nn.Parameter
    #: Its module-qualified name (as ``plugtron.core.training.optimizer.named_params`` gives it).
    name: str
    #: ``[lo, hi)`` of these elements in the flattened parameter, ``param.reshape(-1)``.
    param_range: tuple[int, int]
    #: ``[lo, hi)`` of the same elements in the bucket shard, ``[0, BucketShard.shard_size)``.
    shard_range: tuple[int, int]
    #: 1-D view of the reduced gradient of these elements (the buffer's grad dtype). It holds
    #: the sum over the data-parallel group after ``finish_grad_sync()``.
    grad: torch.Tensor
    #: 1-D view of the parameter's storage for these elements (the model's dtype): writing it
    #: writes the parameter on this rank; ``start_param_sync()`` sends it to the other ranks.
    data: torch.Tensor


@dataclass(frozen=True)
class BucketParam:
    """One parameter of a bucket, whole, where it sits in the bucket."""

    param: torch.nn.Parameter
    name: str
    #: ``[lo, hi)`` of the flattened parameter in the bucket, ``[0, group size x shard_size)``.
    bucket_range: tuple[int, int]


@dataclass(frozen=True)
class BucketShard:
    """This rank's shard of one gradient bucket.

    Every rank of :attr:`group` gets its buckets in the same order, so an optimizer may run a
    collective per bucket (e.g. all-gather its state at checkpoint time: the shards of ranks
    ``0..n-1`` concatenated are the bucket, in which :attr:`params` say where each parameter is).
    """

    #: The process group the bucket is sharded over (data parallel x context parallel, or the
    #: expert data-parallel group for expert parameters).
    group: torch.distributed.ProcessGroup | None
    #: Elements per shard; the bucket is ``group size x shard_size`` elements, padding included.
    shard_size: int
    #: dtype of the model parameters in the bucket.
    param_dtype: torch.dtype
    device: torch.device
    #: Every parameter of the bucket, in bucket order.
    params: tuple[BucketParam, ...]
    #: The parts of those parameters in this rank's shard, in bucket order (empty when the shard
    #: is all padding).
    shards: tuple[ParamShard, ...]


def bucket_shard(bucket: Bucket, names: dict[int, str]) -> BucketShard:
    """Describe this rank's shard of ``bucket``; ``names`` maps ``id(param)`` to its name."""
    buffer = bucket.buffer
    if buffer.param_data is None:
        raise ValueError("a sharded optimizer needs the buffer's parameter copy (the "
                         "distributed optimizer's grad buffers keep one)")
    shard_lo, shard_hi = bucket.shard_range()
    params, shards = [], []
    for param in bucket.params:
        p_lo, p_hi = buffer.ranges[id(param)]
        name = names[id(param)]
        params.append(BucketParam(param, name, (p_lo - bucket.start, p_hi - bucket.start)))
        lo, hi = max(p_lo, shard_lo), min(p_hi, shard_hi)
        if lo < hi:
            shards.append(ParamShard(param, name, (lo - p_lo, hi - p_lo),
                                     (lo - shard_lo, hi - shard_lo),
                                     buffer.grad_data[lo:hi], buffer.param_data[lo:hi]))
    return BucketShard(buffer.group, bucket.shard_size, buffer.param_dtype, bucket.grad.device,
                       tuple(params), tuple(shards))
