"""Causal attention across context-parallel ranks: ring (p2p), all-gather and all-to-all.

Every cp rank holds the sequence chunks ``r`` and ``2cp-1-r`` of each sample
(:mod:`plugtron.core.context_parallel`); its queries must attend to the keys of every earlier
position, most of which live on other ranks. Three ways to bring them together, selected by
``--cp-comm-type`` (Megatron's flag), all autograd-aware and all equal to one process:

* ``p2p`` (:func:`ring_attention`): K/V blocks travel around the cp ring; each rank attends its
  queries to the block it holds and merges the partial results by log-sum-exp (online softmax).
  The causal structure of the load-balanced layout makes every step after the first exactly half
  a block: against an earlier rank's block only its first chunk is visible (to all local
  queries); against a later rank's block only the second local chunk sees anything (all of it).
  The next block's send is posted before the current block is computed, so communication hides
  behind compute. Backward sends the K/V blocks around again with their dK/dV accumulators.
  Memory: q, k, v, the output and the log-sum-exp, no score matrix survives a step.
* ``allgather`` (:func:`all_gather_attention`): K/V all-gathered over cp, local queries attend to
  the whole sequence under a positional causal mask. Simple; holds the full K/V.
* ``a2a`` (:func:`all_to_all_attention`, DeepSpeed-Ulysses): an all-to-all trades the sequence
  split for a head split, each rank runs ordinary causal attention over the whole sequence for
  ``heads / cp`` heads, and a second all-to-all trades back. Needs heads and groups divisible
  by cp.

Shapes are the layer backend's: q ``[b, s_local, heads, d]``, k and v ``[b, s_local, groups, d]``
(grouped-query attention: ``heads`` a multiple of ``groups``), result ``[b, s_local, heads * d]``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm
from .context_parallel import COMM_TYPES, local_positions
from .tensor_parallel import gather_from_sequence_parallel_region

KV_TAG = 10  # K/V blocks going round the ring
GRAD_TAG = 11  # their dK/dV accumulators (backward)


def context_parallel_attention(q, k, v, parallel, comm_type: str = "p2p",
                               dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this cp rank's queries over the whole sequence, by ``comm_type``
    (``p2p``, ``allgather`` or ``a2a``); plain causal attention without cp."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp comm type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
    if parallel.cp_size == 1:
        return _local_causal(q, k, v, dropout_p)
    if comm_type == "p2p":
        if dropout_p:
            raise ValueError("ring attention (p2p) has no attention dropout")
        return ring_attention(q, k, v, parallel.cp_group, parallel.cp_ranks, parallel.cp_rank)
    if comm_type == "allgather":
        return all_gather_attention(q, k, v, parallel.cp_group, parallel.cp_rank,
                                    parallel.cp_size, dropout_p)
    return all_to_all_attention(q, k, v, parallel.cp_group, parallel.cp_size, dropout_p)


def _local_causal(q, k, v, dropout_p=0.0):
    b, s = q.shape[:2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, dropout_p=dropout_p,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).reshape(b, s, -1)


# --------------------------------------------------------------------------- all-gather


def layout_positions(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """Sequence index of every token of the cp ranks' slices laid end to end in rank order."""
    return torch.cat([local_positions(seq_length, r, cp_size, device) for r in range(cp_size)])


def all_gather_attention(q, k, v, group, cp_rank: int, cp_size: int,
                         dropout_p: float = 0.0) -> torch.Tensor:
    """K/V gathered over cp (backward: their gradients reduce-scattered back), local queries
    attend to every key at or before their true position."""
    b, s_local = q.shape[:2]
    seq = s_local * cp_size
    # Gathered in rank order, then put back in sequence order.
    order = torch.argsort(layout_positions(seq, cp_size, q.device))
    k_all = gather_from_sequence_parallel_region(k, group).index_select(1, order)
    v_all = gather_from_sequence_parallel_region(v, group).index_select(1, order)
    q_pos = local_positions(seq, cp_rank, cp_size, q.device)
    mask = q_pos[:, None] >= torch.arange(seq, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2),
                                         v_all.transpose(1, 2), attn_mask=mask,
                                         dropout_p=dropout_p,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).reshape(b, s_local, -1)


# --------------------------------------------------------------------------- all-to-all


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange dimension 0's ``cp`` slices: slice j goes to rank j, slice i of the result came
    from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``[b, s_local, H, d]`` -> ``[b, cp * s_local, H / cp, d]`` (sequence in rank order)."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4)
    out = _all_to_all(x, group)  # [cp (source rank), b, s, H/cp, d]
    return out.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    b, s_all, hc, d = x.shape
    s = s_all // cp
    x = x.reshape(b, cp, s, hc, d).permute(1, 0, 2, 3, 4)
    out = _all_to_all(x, group)  # [cp (head block of rank i), b, s, H/cp, d]
    return out.permute(1, 2, 0, 3, 4).reshape(b, s, cp * hc, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _seq_to_heads(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.cp), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _heads_to_seq(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.cp), None, None


def all_to_all_attention(q, k, v, group, cp_size: int, dropout_p: float = 0.0) -> torch.Tensor:
    """Ulysses: all-to-all to whole sequences of ``1/cp`` of the heads (and groups: rank j gets
    head block j, which is query-group block j since heads are laid out group-major), causal
    attention, all-to-all back."""
    b, s_local, heads, d = q.shape
    if heads % cp_size or k.shape[2] % cp_size:
        raise ValueError(f"a2a context parallelism needs heads ({heads}) and groups "
                         f"({k.shape[2]}) divisible by cp {cp_size}")
    seq = s_local * cp_size
    positions = layout_positions(seq, cp_size, q.device)
    order = torch.argsort(positions)
    q_all, k_all, v_all = (_SeqToHeads.apply(t, group, cp_size).index_select(1, order)
                           for t in (q, k, v))
    out = F.scaled_dot_product_attention(q_all.transpose(1, 2), k_all.transpose(1, 2),
                                         v_all.transpose(1, 2), is_causal=True,
                                         dropout_p=dropout_p,
                                         enable_gqa=q_all.shape[2] != k_all.shape[2])
    # Back to rank order (the inverse permutation of ``order`` is ``positions``).
    out = out.transpose(1, 2).index_select(1, positions)
    return _HeadsToSeq.apply(out, group, cp_size).reshape(b, s_local, -1)


# --------------------------------------------------------------------------- ring (p2p)


class _RingExchange:
    """One ring step's transfer: ``tensor`` to the next cp rank, a fresh one from the previous,
    posted now (async) and completed by :meth:`wait`."""

    def __init__(self, tensor: torch.Tensor, ranks: list[int], rank: int, group, tag: int):
        cp = len(ranks)
        send = tensor.contiguous()
        self.received = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, ranks[(rank + 1) % cp], group, tag),
               dist.P2POp(dist.irecv, self.received, ranks[(rank - 1) % cp], group, tag)]
        self._send = send  # kept alive until the transfer is done
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._send = None
        return self.received


def _visible(step: int, src: int, rank: int, chunk: int):
    """Which query rows and key rows of a ring step can see each other, and whether the causal
    mask applies: (query slice, key slice, causal)."""
    everything = slice(None)
    if step == 0:  # own block: the local tokens are in increasing order, so plain causal
        return everything, everything, True
    if src < rank:  # an earlier rank: only its first chunk is before our tokens, all of it
        return everything, slice(0, chunk), False
    return slice(chunk, None), everything, False  # a later rank: only our second chunk sees it


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V groups repeated to one per query head ``[b, groups, s, d] -> [b, heads, s, d]``."""
    groups = x.shape[1]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of :func:`_expand`: the heads of one group summed."""
    b, heads, s, d = grad.shape
    if heads == groups:
        return grad
    return grad.view(b, groups, heads // groups, s, d).sum(2)


def _scores(q, k, scale, causal):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1 + sk - sq)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _block_forward(q, k, v, scale, causal):
    """Attention of one block in fp32: (output, log-sum-exp of the scores per query row)."""
    scores = _scores(q, _expand(k, q.shape[1]), scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs, _expand(v, q.shape[1])), lse


def _block_backward(q, k, v, out, lse, grad_out, delta, scale, causal):
    """Flash-attention backward of one block, given the *final* output's log-sum-exp and
    ``delta = rowsum(grad_out * out)``: (dq, dk, dv), dk/dv per group."""
    heads, groups = q.shape[1], k.shape[1]
    k_e, v_e = _expand(k, heads), _expand(v, heads)
    probs = torch.exp(_scores(q, k_e, scale, causal) - lse[..., None])
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_scores = probs * (torch.matmul(grad_out, v_e.transpose(-1, -2)) - delta[..., None])
    grad_q = torch.matmul(grad_scores, k_e) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
    return grad_q, _fold(grad_k, groups), _fold(grad_v, groups)


class _RingAttention(torch.autograd.Function):
    """q ``[b, heads, s, d]``, k/v ``[b, groups, s, d]`` (fp32 inside) -> output like q."""

    @staticmethod
    def forward(ctx, q, k, v, group, ranks, rank):
        cp, chunk = len(ranks), q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            # Post the next block's transfer first: it travels while this block is computed.
            pending = _RingExchange(kv, ranks, rank, group, KV_TAG) if step < cp - 1 else None
            rows, cols, causal = _visible(step, (rank - step) % cp, rank, chunk)
            block_out, block_lse = _block_forward(qf[:, :, rows], kv[0][:, :, cols].float(),
                                                  kv[1][:, :, cols].float(), scale, causal)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
                               + block_out * torch.exp(block_lse - merged)[..., None])
            lse[:, :, rows] = merged
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ranks, ctx.rank, ctx.scale = group, ranks, rank, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, ranks, rank, scale = ctx.group, ctx.ranks, ctx.rank, ctx.scale
        cp, chunk = len(ranks), q.shape[2] // 2
        qf, grad_out = q.float(), grad_out.float()
        delta = (grad_out * out).sum(-1)
        grad_q = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        returning = None  # the dK/dV accumulator arriving with the current block
        for step in range(cp):
            pending = _RingExchange(kv, ranks, rank, group, KV_TAG) if step < cp - 1 else None
            rows, cols, causal = _visible(step, (rank - step) % cp, rank, chunk)
            dq, dk, dv = _block_backward(qf[:, :, rows], kv[0][:, :, cols].float(),
                                         kv[1][:, :, cols].float(), out[:, :, rows],
                                         lse[:, :, rows], grad_out[:, :, rows],
                                         delta[:, :, rows], scale, causal)
            grad_q[:, :, rows] += dq
            grad_kv = (torch.zeros(2, *k.shape, dtype=torch.float32, device=k.device)
                       if returning is None else returning.wait())
            grad_kv[0][:, :, cols] += dk
            grad_kv[1][:, :, cols] += dv
            # The accumulator follows its block: after cp hops it is home, complete.
            returning = _RingExchange(grad_kv, ranks, rank, group, GRAD_TAG)
            if pending is not None:
                kv = pending.wait()
        grad_kv = returning.wait()
        return (grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype),
                None, None, None)


def ring_attention(q, k, v, group, ranks: list[int], rank: int) -> torch.Tensor:
    """Ring attention over the cp group (``ranks``: its global ranks, ``rank``: this rank's
    index in it). Layer-backend shapes (see the module docstring)."""
    b, s = q.shape[:2]
    if s % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {s}")
    if comm.group_size(group) == 1:
        return _local_causal(q, k, v)
    out = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group,
                               list(ranks), rank)
    return out.transpose(1, 2).reshape(b, s, -1)
