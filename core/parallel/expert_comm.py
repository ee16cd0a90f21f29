"""Autograd-aware all-to-all with uneven splits, the collective of expert parallelism.

MoE token dispatchers (plugtron-moe's ``alltoall``, or a third party's) send each rank's tokens
to the ranks holding their experts: rank ``i`` sends ``input_splits[j]`` rows to rank ``j`` and
receives ``output_splits[j]`` rows from it. The backward pass is the same exchange reversed
(the gradient of the rows a rank received goes back to the rank that sent them), so the
function is differentiable end to end. It lives in core, next to the tensor-parallel
collectives, because any plugin that moves rows between ranks needs it.

With one process, or a group of ``None`` / size 1, it is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from plugtron.core.parallel import comm


def _exchange(x: torch.Tensor, group, output_splits: list[int],
              input_splits: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all(x: torch.Tensor, group, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None) -> torch.Tensor:
    """Exchange rows of ``x`` (dim 0) over ``group``: ``input_splits[j]`` rows (in order) go to
    group rank ``j``, ``output_splits[j]`` rows come from it, concatenated in rank order.
    Equal splits when both are ``None``. Backward runs the reverse exchange."""
    n = comm.group_size(group)
    if n == 1:
        return x
    if input_splits is None and output_splits is None:
        if x.shape[0] % n:
            raise ValueError(f"all_to_all: {x.shape[0]} rows do not split evenly over {n} ranks")
        input_splits = output_splits = [x.shape[0] // n] * n
    if input_splits is None or output_splits is None:
        raise ValueError("all_to_all: give both output_splits and input_splits, or neither")
    if len(input_splits) != n or len(output_splits) != n or sum(input_splits) != x.shape[0]:
        raise ValueError(f"all_to_all: splits {input_splits} / {output_splits} do not fit "
                         f"{x.shape[0]} rows over {n} ranks")
    return _AllToAll.apply(x, group, [int(s) for s in output_splits],
                           [int(s) for s in input_splits])


def all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal-sized count rows (no autograd): ``counts`` is ``[n, ...]`` with row ``j``
    for group rank ``j``; the result's row ``j`` is what rank ``j`` had for this rank.
    ``counts`` must be on the device the group's backend exchanges (the tokens' device: nccl
    takes cuda tensors only)."""
    if comm.group_size(group) == 1:
        return counts
    return _exchange(counts, group, [1] * counts.shape[0], [1] * counts.shape[0])
