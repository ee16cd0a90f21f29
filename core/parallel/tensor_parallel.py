"""Autograd-aware collectives of tensor and sequence parallelism (Megatron's ``mappings``).

Each function is a differentiable region boundary: its forward does one collective and its
backward does the collective that makes the gradients right. They are shared by every layer
backend, MoE and context parallelism, so they live in core. ``group`` is a process group, or
``None`` with one process: then every function is the identity (see :mod:`plugtron.core.parallel.comm`).

Tensor-parallel region (features split over tp, ``dim`` defaults to the last one):

=====================================  =====================  =====================
function                               forward                backward
=====================================  =====================  =====================
``copy_to_tensor_parallel_region``     identity               all-reduce
``reduce_from_tensor_parallel_region`` all-reduce             identity
``scatter_to_tensor_parallel_region``  keep own chunk         all-gather
``gather_from_tensor_parallel_region`` all-gather             keep own chunk
=====================================  =====================  =====================

Sequence parallelism (activations ``[batch, seq, hidden]`` split along ``seq_dim``, default 1):

=============================================  ==============  ===========================
function                                       forward         backward
=============================================  ==============  ===========================
``scatter_to_sequence_parallel_region``        keep own chunk  all-gather
``gather_from_sequence_parallel_region``       all-gather      reduce-scatter (or chunk)
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter  all-gather
=============================================  ==============  ===========================

:func:`sequence_parallel_linear` fuses the sequence all-gather with the column-parallel matmul so
that only this rank's sequence shard is kept for backward (Megatron's SP linear): the gathered
input is rebuilt in backward by a second all-gather, trading communication for activation
memory.

Collectives never modify their input or the incoming gradient in place: autograd may hand the
same gradient tensor to several consumers (a residual add does), so reductions work on copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.core.blocks.linear import input_grad, linear, weight_grad
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.parallel import comm
from plugtron.core.parallel.sharding import local_block_sizes


def _own_chunk(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"tensor-parallel size {n}")
    return x.chunk(n, dim=dim)[comm.group_rank(group)].contiguous()


def _all_reduced(x: torch.Tensor, group) -> torch.Tensor:
    if comm.group_size(group) == 1:
        return x
    return comm.all_reduce(x.clone(memory_format=torch.contiguous_format), group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_tensor(grad, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather_tensor(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, tensor_parallel_output_grad):
        ctx.group, ctx.dim = group, dim
        ctx.reduce_grad = tensor_parallel_output_grad
        return comm.all_gather_tensor(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            out = comm.reduce_scatter_tensor(grad, ctx.group, ctx.dim)
        else:
            out = _own_chunk(grad, ctx.group, ctx.dim)
        return out, None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.reduce_scatter_tensor(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_tensor(grad, ctx.group, ctx.dim), None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    """A non-negative dim, so autograd functions slice the same axis in forward and backward."""
    return dim % x.dim()


def _alone(group) -> bool:
    """One rank in the group: every region boundary is the identity (no autograd node)."""
    return comm.group_size(group) == 1


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tp region with replicated input: each rank's gradient is partial, so backward
    sums it over tp."""
    if _alone(group):
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tp region whose outputs are partial sums (row-parallel linear, vocab-parallel
    embedding): forward sums over tp; the gradient is already replicated."""
    if _alone(group):
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of replicated ``x`` along ``dim``; backward gathers."""
    if _alone(group):
        return x
    return _ScatterToRegion.apply(x, group, _dim(x, dim))


def gather_from_tensor_parallel_region(x: torch.Tensor, group, dim: int = -1,
                                       chunks: int | tuple[int, ...] = 1) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` (rank order); backward keeps own chunk.

    ``chunks`` > 1 (or a tuple of full block sizes): each rank's piece is blocks ([gate_r; up_r])
    of a tensor whose blocks were split separately (``sharding.shard_of`` with chunks); the
    result is put back in block order ([gate; up])."""
    if _alone(group):
        return x
    dim = _dim(x, dim)
    out = _GatherFromRegion.apply(x, group, dim)
    if chunks != 1:
        size = comm.group_size(group)
        local = local_block_sizes(x.shape[dim], size, chunks)
        per_rank = [part.split(local, dim=dim) for part in out.chunk(size, dim)]
        out = torch.cat([blocks[c] for c in range(len(local)) for blocks in per_rank], dim=dim)
    return out


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
    """Shard replicated activations along the sequence; backward all-gathers."""
    if _alone(group):
        return x
    return _ScatterToRegion.apply(x, group, _dim(x, seq_dim))


def gather_from_sequence_parallel_region(x: torch.Tensor, group, seq_dim: int = 1,
                                         tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """All-gather sequence-sharded activations.

    ``tensor_parallel_output_grad``: the gathered tensor feeds a tp region (a column-parallel
    linear), so each rank's gradient is a partial sum and backward reduce-scatters it. Pass
    ``False`` when the consumer is replicated (every rank computes the same gradient): backward
    then only keeps this rank's chunk.
    """
    if _alone(group):
        return x
    return _GatherFromSequence.apply(x, group, _dim(x, seq_dim), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group,
                                               seq_dim: int = 1) -> torch.Tensor:
    """Sum partial outputs over tp and keep this rank's sequence chunk (row-parallel linear
    under sequence parallelism); backward all-gathers."""
    if _alone(group):
        return x
    return _ReduceScatterToSequence.apply(x, group, _dim(x, seq_dim))


class _SequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, dim):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.dim, ctx.has_bias = group, dim, bias is not None
        ctx.weight = weight  # the parameter itself, for deferral (see blocks/linear.py)
        return F.linear(comm.all_gather_tensor(x, group, dim), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = input_grad(flat_grad, weight).view(*grad.shape[:-1], weight.shape[1])
            grad_x = comm.reduce_scatter_tensor(grad_x, ctx.group, ctx.dim)
        if ctx.needs_input_grad[1]:
            group, dim = ctx.group, ctx.dim

            def compute():
                # At W (deferred) the shard is gathered again then: nothing but x is held.
                full = comm.all_gather_tensor(x, group, dim)
                return weight_grad(flat_grad, full.reshape(-1, full.shape[-1]), weight)

            if not wgrad.defer_weight_grad(ctx.weight, compute):
                grad_weight = compute()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(dim=0)
        return grad_x, grad_weight, grad_bias, None, None


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group, seq_dim: int = 1) -> torch.Tensor:
    """``F.linear(gather_from_sequence_parallel_region(x), weight, bias)`` that keeps only the
    sequence shard ``x`` for backward: the weight gradient re-gathers it, the input gradient
    is reduce-scattered back to the shard."""
    if _alone(group):
        return linear(x, weight, bias)
    return _SequenceParallelLinear.apply(x, weight, bias, group, _dim(x, seq_dim))
