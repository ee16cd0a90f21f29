"""Asynchronous collectives for overlapping communication with compute.

Each returns a work handle with ``wait()``, or ``None`` when there is nothing to communicate
(a ``None`` group or a group of one, as in :mod:`plugtron.core.parallel.comm`). They never copy: the
caller owns the tensors until ``wait()`` returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from plugtron.core.parallel import comm


def all_reduce_async(tensor: torch.Tensor, group):
    """Start summing ``tensor`` in place over ``group``."""
    if comm.group_size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=comm.SUM, group=group, async_op=True)


def reduce_scatter_async(output: torch.Tensor, tensor: torch.Tensor, group):
    """Start summing ``tensor`` (1-D, length divisible by the group size) over ``group``; this
    rank's ``1/n`` chunk lands in ``output``."""
    if comm.group_size(group) == 1:
        output.copy_(tensor)
        return None
    if comm._reduce_scatter_single is not None:
        return comm._reduce_scatter_single(output, tensor, op=comm.SUM, group=group,
                                           async_op=True)
    chunks = list(tensor.chunk(comm.group_size(group)))
    return dist.reduce_scatter(output, chunks, op=comm.SUM, group=group, async_op=True)


def all_gather_async(output: torch.Tensor, tensor: torch.Tensor, group):
    """Start concatenating every rank's ``tensor`` (1-D, same length everywhere) into
    ``output`` in rank order."""
    if comm.group_size(group) == 1:
        if output.data_ptr() != tensor.data_ptr():
            output.copy_(tensor)
        return None
    if comm._all_gather_single is not None:
        return comm._all_gather_single(output, tensor, group=group, async_op=True)
    parts = list(output.chunk(comm.group_size(group)))
    return dist.all_gather(parts, tensor, group=group, async_op=True)
