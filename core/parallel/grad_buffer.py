"""Contiguous gradient buffers split into buckets (Megatron-Core's ParamAndGradBuffer).

A :class:`GradBuffer` holds the gradients of a set of parameters that share a dtype and a
reduction group in one flat tensor; each parameter's ``main_grad`` is a view into it. Parameters
are laid out in the order given (the wrapper passes them in reverse model order, roughly the
order backward produces their gradients) and cut into buckets: a bucket closes as soon as it
holds at least ``bucket_size`` elements. Each bucket is reduced with one collective.

Sharded mode (for the distributed optimizer): every bucket is padded so that the data-parallel
ranks own equal contiguous shards of it, regardless of parameter boundaries; the reduction is a
reduce-scatter (each rank gets the sum only for its shard; on gloo an in-place all-reduce,
and its all-gather one over the shards with -0.0 elsewhere,
``comm.prefers_all_reduce``), and the parameters live in a flat
buffer too (``param.data`` is a view), so that an all-gather of the shards refreshes them.
A parameter shared between stages (``shared_group``, see core/parallel/shared_params.py) gets a bucket of its own then, so that the first and
last pipeline stage shard it identically and can sum its (reduced) shard afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from plugtron.core.parallel import comm
from plugtron.core.parallel.async_comm import (
    all_gather_async,
    all_reduce_async,
    reduce_scatter_async,
)

#: Megatron's default bucket size: ``max(40M, 1M x dp)`` elements.
MIN_DEFAULT_BUCKET_SIZE = 40_000_000


def main_grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 (or grad-dtype) gradient a buffer keeps for ``param``: Megatron's ``main_grad``
    attribute, set when the buffer is built."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        raise RuntimeError("the parameter has no main_grad: it is in no gradient buffer")
    return grad


def default_bucket_size(dp_size: int) -> int:
    return max(MIN_DEFAULT_BUCKET_SIZE, 1_000_000 * dp_size)


def shard_alignment(group_size: int) -> int:
    """Sharded buckets are padded to a multiple of this (equal shards; 128-element alignment
    keeps NCCL on its fast path)."""
    return math.lcm(group_size, 128)


@dataclass(frozen=True)
class BucketPlan:
    start: int
    end: int  # includes the padding
    params: tuple[int, ...]  # indices into the parameter list


def plan_buckets(numels: list[int], bucket_size: int, alignment: int = 1,
                 own_bucket: list[bool] | None = None) -> tuple[list[tuple[int, int]],
                                                              list[BucketPlan]]:
    """Pure layout: ``(param ranges, buckets)`` for parameters of ``numels`` elements in order.

    A bucket closes once it holds ``>= bucket_size`` elements; its end is padded up to a
    multiple of ``alignment``. ``own_bucket[i]`` puts parameter ``i`` alone in a bucket.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be at least 1, got {bucket_size}")
    own_bucket = own_bucket or [False] * len(numels)
    ranges: list[tuple[int, int]] = []
    buckets: list[BucketPlan] = []
    offset, bucket_start = 0, 0
    members: list[int] = []

    def close():
        nonlocal offset, bucket_start, members
        end = -(-offset // alignment) * alignment
        buckets.append(BucketPlan(bucket_start, end, tuple(members)))
        offset = bucket_start = end
        members = []

    for index, numel in enumerate(numels):
        if own_bucket[index] and members:
            close()
        ranges.append((offset, offset + numel))
        offset += numel
        members.append(index)
        if offset - bucket_start >= bucket_size or own_bucket[index]:
            close()
    if members:
        close()
    return ranges, buckets


class Bucket:
    """One collective's worth of a buffer, with its in-flight work."""

    def __init__(self, buffer: GradBuffer, index: int, plan: BucketPlan):
        self.buffer, self.index = buffer, index
        self.start, self.end = plan.start, plan.end
        self.params = [buffer.params[i] for i in plan.params]
        self.grad = buffer.grad_data[plan.start:plan.end]
        self.param_data = (buffer.param_data[plan.start:plan.end]
                           if buffer.param_data is not None else None)
        self.pending: set[int] = set()
        self.launched = False
        self._grad_work = None
        self._shard_out: torch.Tensor | None = None
        self._gather_work = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.buffer.group_size

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """Element range of ``rank``'s shard (default: this rank's) in buffer coordinates."""
        rank = self.buffer.group_rank if rank is None else rank
        first = self.start + rank * self.shard_size
        return first, first + self.shard_size

    # ------------------------------------------------------------------ gradient reduction

    def start_grad_reduction(self) -> None:
        self.launched = True
        group = self.buffer.group
        if not self.buffer.sharded:
            self._grad_work = all_reduce_async(self.grad, group)
        elif comm.group_size(group) > 1 and comm.prefers_all_reduce(group):
            # The whole bucket summed in place: this rank's shard is then its slice, and the
            # other slices (which the optimizer never reads) hold sums too.
            self._grad_work = all_reduce_async(self.grad, group)
        elif comm.group_size(group) > 1:
            self._shard_out = torch.empty(self.shard_size, dtype=self.grad.dtype,
                                          device=self.grad.device)
            self._grad_work = reduce_scatter_async(self._shard_out, self.grad, group)

    def finish_grad_reduction(self) -> None:
        if self._grad_work is not None:
            self._grad_work.wait()
            self._grad_work = None
        if self._shard_out is not None:
            lo, hi = self.shard_range()
            self.buffer.grad_data[lo:hi].copy_(self._shard_out)
            self._shard_out = None

    @property
    def reduction_pending(self) -> bool:
        """Started and not yet waited for."""
        return self._grad_work is not None

    # ------------------------------------------------------------------ parameter gather

    def start_param_gather(self) -> None:
        whole = self.buffer.param_data
        if self.param_data is None or whole is None or comm.group_size(self.buffer.group) == 1:
            return
        lo, hi = self.shard_range()
        if comm.prefers_all_reduce(self.buffer.group):
            # Every rank's shard summed with -0.0 from the others: x + -0.0 is x bit for bit
            # (+0.0 and NaN included), in any order.
            whole[self.start:lo].fill_(-0.0)
            whole[hi:self.end].fill_(-0.0)
            self._gather_work = all_reduce_async(self.param_data, self.buffer.group)
            return
        local = whole[lo:hi].clone()
        self._gather_work = all_gather_async(self.param_data, local, self.buffer.group)

    def finish_param_gather(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None

    @property
    def gather_pending(self) -> bool:
        return self._gather_work is not None


class GradBuffer:
    """Gradients (and, sharded, parameters) of ``params`` in one flat tensor, in buckets."""

    def __init__(self, params: list[torch.nn.Parameter], grad_dtype: torch.dtype, group,
                 group_size: int, group_rank: int, bucket_size: int, sharded: bool):
        self.params = list(params)
        self.param_dtype = self.params[0].dtype
        self.grad_dtype = grad_dtype
        self.group, self.group_size, self.group_rank = group, group_size, group_rank
        self.sharded = sharded
        device = self.params[0].device
        own = [sharded and bool(getattr(p, "shared_group", None)) for p in self.params]
        ranges, plans = plan_buckets([p.numel() for p in self.params], bucket_size,
                                     shard_alignment(group_size) if sharded else 1, own)
        self.numel = plans[-1].end
        self.ranges = {id(p): r for p, r in zip(self.params, ranges)}
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if sharded:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
            with torch.no_grad():
                for p, (lo, hi) in zip(self.params, ranges):
                    self.param_data[lo:hi].copy_(p.data.reshape(-1))
                    p.data = self.param_data[lo:hi].view(p.shape)
        for p, (lo, hi) in zip(self.params, ranges):
            setattr(p, "main_grad", self.grad_data[lo:hi].view(p.shape))
        self.buckets = [Bucket(self, i, plan) for i, plan in enumerate(plans)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self.reset()

    def reset(self) -> None:
        """Forget the previous iteration's readiness (every bucket waits for all its grads)."""
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.launched = False
        self._next_launch = 0

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """``param``'s last-microbatch gradient is in; launch every bucket that is complete, in
        bucket order (the same order on every rank, as collectives require)."""
        bucket = self.bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                f"a gradient arrived for a parameter of bucket {bucket.index} after that "
                f"bucket's reduction had started: run every microbatch but the last of an "
                f"iteration under no_sync()")
        bucket.pending.discard(id(param))
        while (self._next_launch < len(self.buckets)
               and not self.buckets[self._next_launch].pending):
            self.buckets[self._next_launch].start_grad_reduction()
            self._next_launch += 1

    def launch_remaining(self) -> None:
        """Start, in order, every bucket not started yet (e.g. with overlap off)."""
        while self._next_launch < len(self.buckets):
            self.buckets[self._next_launch].start_grad_reduction()
            self._next_launch += 1

    def finish_grad_reduction(self) -> None:
        self.launch_remaining()
        for bucket in self.buckets:
            bucket.finish_grad_reduction()
        self.reset()

    def zero_grads(self) -> None:
        self.grad_data.zero_()
