"""Causal attention across context-parallel ranks: ring (p2p), all-gather and all-to-all.

Every cp rank holds the sequence chunks ``r`` and ``2cp-1-r`` of each sample
(:mod:`plugtron.core.parallel.context_parallel`); its queries must attend to the keys of every earlier
position, most of which live on other ranks. Three ways to bring them together, selected by
``--cp-comm-type`` (Megatron's flag), all autograd-aware and all equal to one process:

* ``p2p`` (:func:`ring_attention`): K/V blocks travel around the cp ring; each rank attends its
  queries to the block it holds and merges the partial results by log-sum-exp (online softmax).
  The causal structure of the load-balanced layout skips every fully masked part: at step 0 the
  first local chunk does not look at the second; every later step is exactly half a block: against an earlier rank's block only its first chunk is visible (to all local
  queries); against a later rank's block only the second local chunk sees anything (all of it).
  The next block's transfer is posted before the current block is computed and waited for after,
  so communication hides behind compute. Backward sends the K/V blocks around again with their
  dK/dV accumulators.
* ``allgather`` (:func:`all_gather_attention`): K/V all-gathered over cp; each local chunk
  attends to the prefix of the sequence up to its end (Megatron's all-gather cp works chunk by
  chunk the same way). The gathered K/V is dropped after forward and gathered again in backward,
  whose dK/dV are reduce-scattered home.
* ``a2a`` (:func:`all_to_all_attention`, DeepSpeed-Ulysses): an all-to-all trades the sequence
  split for a head split, each rank runs ordinary causal attention over the whole sequence for
  ``heads / cp`` heads, and a second all-to-all trades back. Needs heads and groups divisible
  by cp.

Memory: all three keep for backward only tensors of the local tokens' size (q, k, v, the output
and the log-sum-exp, for a2a those of its head slice), so attention activations per rank are
1/cp of one process's; p2p and allgather recompute the scores block by block
(:mod:`plugtron.core.parallel.attention_blocks`). Attention dropout: p2p and allgather draw a positional
mask (:func:`plugtron.core.parallel.attention_blocks.keep_mask`), a2a torch's own.

Shapes are the layer backend's: q ``[b, s_local, heads, d]``, k and v ``[b, s_local, groups, d]``
(grouped-query attention: ``heads`` a multiple of ``groups``), result ``[b, s_local, heads * d]``.
Values may be narrower than queries and keys (multi-latent attention): a2a takes them as they
are, p2p and all-gather pad them with zeros to the key size and drop those channels after.

Packed documents: ``document_ids`` (``[b, seq]``, the whole sequence's document numbers, which
the cp split leaves whole) restrict each query to keys of its own document in all three. Where
the batch split cut each document in ``2 x cp`` parts (Megatron's THD layout,
:func:`plugtron.core.parallel.context_parallel.chunk_order`), chunk ``c`` is the ``c``-th part of
every document: the ring's and all-gather's skipping of masked blocks holds as for one sequence,
each query and key addressed by its true position (per sample, ``[b, rows]``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from plugtron.core.parallel import comm
from plugtron.core.parallel.attention_blocks import block_backward, block_forward, draw_dropout
from plugtron.core.parallel.context_parallel import (
    COMM_TYPES,
    chunk_order,
    local_chunk_ids,
    local_positions,
    rank_positions,
)

KV_TAG = 10  # K/V blocks going round the ring
GRAD_TAG = 11  # their dK/dV accumulators (backward)


def context_parallel_attention(q, k, v, parallel, comm_type: str = "p2p",
                               dropout_p: float = 0.0,
                               document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries over the whole sequence, by ``comm_type``
    (``p2p``, ``allgather`` or ``a2a``); plain causal attention without cp. Dropout randomness
    is drawn from the current random stream (the caller's dropout stream).

    ``document_ids``: ``[b, seq]`` document numbers of the WHOLE sequence in sequence order
    (packed documents; the batch's ``attention_mask``, which the cp split leaves whole): a token
    then sees only earlier tokens of its own document, wherever they live."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp comm type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
    if parallel.cp_size == 1:
        return _local_causal(q, k, v, dropout_p, document_ids)
    if document_ids is not None:
        document_ids = document_ids.to(q.device)
        if document_ids.shape[1] != q.shape[1] * parallel.cp_size:
            raise ValueError(f"document_ids cover {document_ids.shape[1]} positions, the "
                             f"sequence {q.shape[1] * parallel.cp_size}")
    if comm_type != "a2a" and v.shape[-1] != k.shape[-1]:
        return _padded_values(q, k, v, parallel, comm_type, dropout_p, document_ids)
    if comm_type == "p2p":
        return ring_attention(q, k, v, parallel.cp_group, parallel.cp_ranks, parallel.cp_rank,
                              dropout_p, document_ids)
    if comm_type == "allgather":
        return all_gather_attention(q, k, v, parallel.cp_group, parallel.cp_rank,
                                    parallel.cp_size, dropout_p, document_ids)
    return all_to_all_attention(q, k, v, parallel.cp_group, parallel.cp_size, dropout_p,
                                document_ids)


def _docs_at(docs, positions):
    """Document numbers at ``positions`` (``[n]`` or ``[b, n]``), or None without documents."""
    if docs is None:
        return None
    return docs[:, positions] if positions.dim() == 1 else docs.gather(1, positions)


def _padded_values(q, k, v, parallel, comm_type: str, dropout_p: float,
                   document_ids=None) -> torch.Tensor:
    """Values narrower than the keys (multi-latent attention: 128 value channels against 192
    query/key ones): the ring and all-gather paths move keys and values as one tensor, so the
    values travel zero-padded to the key size. Zero channels of v give zero channels of the
    output, which are dropped; their gradient is dropped with them, so the result and every
    gradient equal attention over the narrow values."""
    dv, dk = v.shape[-1], k.shape[-1]
    if dv > dk:
        raise ValueError(f"cp comm type {comm_type!r} needs value heads ({dv}) no wider than "
                         f"key heads ({dk}); a2a takes any")
    padded = F.pad(v, (0, dk - dv))
    out = context_parallel_attention(q, k, padded, parallel, comm_type, dropout_p,
                                     document_ids)
    b, s, heads = q.shape[:3]
    return out.view(b, s, heads, dk)[..., :dv].reshape(b, s, heads * dv)


def _document_mask(document_ids: torch.Tensor, positions=None) -> torch.Tensor:
    """``[b, 1, s, s]``: causal, and within each document (``document_ids`` ``[b, s]`` of tokens
    at ``positions``, ``[s]`` or ``[b, s]``; in sequence order without)."""
    s = document_ids.shape[1]
    if positions is None:
        causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    else:
        causal = positions[..., None, :] <= positions[..., :, None]
    return (causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]


def _local_causal(q, k, v, dropout_p=0.0, document_ids=None):
    b, s = q.shape[:2]
    mask = None if document_ids is None else _document_mask(document_ids.to(q.device))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=mask is None, attn_mask=mask,
                                         dropout_p=dropout_p,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).reshape(b, s, -1)


def _heads_first(q, k, v):
    """Layer-backend layout ``[b, s, h, d]`` to the kernels' ``[b, h, s, d]``."""
    return (t.transpose(1, 2) for t in (q, k, v))


def _sequence_first(out: torch.Tensor) -> torch.Tensor:
    b, _, s, _ = out.shape
    return out.transpose(1, 2).reshape(b, s, -1)


def layout_positions(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """Sequence index of every token of the cp ranks' slices laid end to end in rank order."""
    return torch.cat([local_positions(seq_length, r, cp_size, device) for r in range(cp_size)])


# --------------------------------------------------------------------------- all-gather


def _gather_kv(kv: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``[2, b, g, s_local, d]`` of every cp rank -> ``[2, b, g, seq, d]`` in sequence order."""
    two, b, g, s, d = kv.shape
    parts = comm.all_gather_tensor(kv.unsqueeze(0), group)  # [cp, 2, b, g, s, d], rank order
    ranked = parts.permute(1, 2, 3, 0, 4, 5).reshape(two, b, g, cp * s, d)
    order = torch.argsort(layout_positions(cp * s, cp, kv.device))
    return ranked.index_select(3, order)


def _scatter_kv_grad(grad: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of :func:`_gather_kv` for gradients: every rank's ``[2, b, g, seq, d]`` summed,
    each rank keeping its own tokens ``[2, b, g, s_local, d]``."""
    two, b, g, seq, d = grad.shape
    ranked = grad.index_select(3, layout_positions(seq, cp, grad.device))
    parts = ranked.view(two, b, g, cp, seq // cp, d).permute(3, 0, 1, 2, 4, 5)
    return comm.reduce_scatter_tensor(parts.contiguous(), group)[0]


class _AllGatherAttention(torch.autograd.Function):
    """q ``[b, heads, s, d]``, k/v ``[b, groups, s, d]`` -> output like q. Saves the local q, k,
    v, the output and the log-sum-exp only; the gathered K/V lives for one pass at a time."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp_rank, cp_size, dropout, docs):
        chunk = q.shape[2] // 2
        seq = 2 * chunk * cp_size
        scale = 1.0 / math.sqrt(q.shape[-1])
        kv = _gather_kv(torch.stack([k, v]), group, cp_size)  # in chunk order
        k_pos = chunk_order(docs, seq, cp_size, q.device)  # sequence positions in chunk order
        q_pos = rank_positions(k_pos, cp_rank, cp_size)
        q_doc, k_doc = _docs_at(docs, q_pos), _docs_at(docs, k_pos)
        out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for i, chunk_id in enumerate(local_chunk_ids(cp_rank, cp_size)):
            # the keys of chunks up to this one: a prefix in chunk order
            rows, end = slice(i * chunk, (i + 1) * chunk), (chunk_id + 1) * chunk
            out[:, :, rows], lse[:, :, rows] = block_forward(
                q[:, :, rows], kv[0][:, :, :end], kv[1][:, :, :end], q_pos[..., rows],
                k_pos[..., :end], scale, True, dropout, _part(q_doc, rows),
                _part(k_doc, slice(0, end)))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp_rank, ctx.cp_size, ctx.dropout = group, cp_rank, cp_size, dropout
        ctx.docs, ctx.k_pos = docs, k_pos
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp_rank, cp_size = ctx.cp_rank, ctx.cp_size
        chunk = q.shape[2] // 2
        kv = _gather_kv(torch.stack([k, v]), ctx.group, cp_size)
        docs, k_pos = ctx.docs, ctx.k_pos
        q_pos = rank_positions(k_pos, cp_rank, cp_size)
        q_doc, k_doc = _docs_at(docs, q_pos), _docs_at(docs, k_pos)
        grad_q = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for i, chunk_id in enumerate(local_chunk_ids(cp_rank, cp_size)):
            rows, end = slice(i * chunk, (i + 1) * chunk), (chunk_id + 1) * chunk
            grad_q[:, :, rows], dk, dv = block_backward(
                q[:, :, rows], kv[0][:, :, :end], kv[1][:, :, :end], out[:, :, rows],
                lse[:, :, rows], grad_out[:, :, rows], q_pos[..., rows], k_pos[..., :end],
                ctx.scale, True, ctx.dropout, _part(q_doc, rows), _part(k_doc, slice(0, end)))
            grad_kv[0][:, :, :end] += dk
            grad_kv[1][:, :, :end] += dv
        del kv
        grad_kv = _scatter_kv_grad(grad_kv, ctx.group, cp_size)
        return (grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype),
                None, None, None, None, None)


def _part(docs, index):
    return None if docs is None else docs[:, index]


def all_gather_attention(q, k, v, group, cp_rank: int, cp_size: int,
                         dropout_p: float = 0.0, document_ids=None) -> torch.Tensor:
    """K/V gathered over cp, each local chunk attending causally to the sequence up to its end;
    backward gathers K/V again and reduce-scatters their gradients."""
    if q.shape[1] % 2:
        raise ValueError(f"all-gather cp attention needs an even local sequence (two chunks), "
                         f"got {q.shape[1]}")
    if comm.group_size(group) == 1:
        return _local_causal(q, k, v, dropout_p, document_ids)
    dropout = draw_dropout(dropout_p, q.device)
    return _sequence_first(_AllGatherAttention.apply(*_heads_first(q, k, v), group, cp_rank,
                                                     cp_size, dropout, document_ids))


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


@contextlib.contextmanager
def _head_block_dropout_stream(dropout_p: float, device, cp_rank: int):
    """cp ranks share their dropout stream, but under a2a each holds different heads: torch's
    dropout draws from a seed taken from the shared stream plus the cp rank, so head blocks get
    independent masks (the shared stream advances alike on every rank)."""
    if not dropout_p:
        yield
        return
    dropout = draw_dropout(dropout_p, device)
    seed = (dropout.seed if dropout is not None else 0) + cp_rank
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        yield


def all_to_all_attention(q, k, v, group, cp_size: int, dropout_p: float = 0.0,
                         document_ids=None) -> torch.Tensor:
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
                           for t in (q, k, v))  # in chunk order
    mask = None
    if document_ids is not None:
        true_positions = chunk_order(document_ids, seq, cp_size, q.device)
        mask = _document_mask(_docs_at(document_ids, true_positions), true_positions)
    with _head_block_dropout_stream(dropout_p, q.device, comm.group_rank(group)):
        out = F.scaled_dot_product_attention(q_all.transpose(1, 2), k_all.transpose(1, 2),
                                             v_all.transpose(1, 2), is_causal=mask is None,
                                             attn_mask=mask, dropout_p=dropout_p,
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
        self._send: torch.Tensor | None = send  # kept alive until the transfer is done
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._send = None
        return self.received


def _visible(step: int, src: int, rank: int, chunk: int):
    """The parts of a ring step's block that can see each other: [(query rows, key rows,
    causal)], fully masked parts left out."""
    everything, first, second = slice(None), slice(0, chunk), slice(chunk, None)
    if step == 0:  # own block, local tokens in increasing order: the first chunk cannot see
        return [(first, first, True), (second, everything, True)]  # the second: skipped
    if src < rank:  # an earlier rank: only its first chunk is before our tokens, all of it
        return [(everything, first, False)]
    return [(second, everything, False)]  # a later rank: only our second chunk sees it


class _RingAttention(torch.autograd.Function):
    """q ``[b, heads, s, d]``, k/v ``[b, groups, s, d]`` -> output like q. Saves the local q, k,
    v, the output and the log-sum-exp only: no received block outlives its ring step."""

    @staticmethod
    def forward(ctx, q, k, v, group, ranks, rank, dropout, docs):
        cp, chunk = len(ranks), q.shape[2] // 2
        seq = 2 * chunk * cp
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        order = chunk_order(docs, seq, cp, q.device)
        q_pos = rank_positions(order, rank, cp)
        q_doc = _docs_at(docs, q_pos)
        kv = torch.stack([k, v])
        for step in range(cp):
            # Post the next block's transfer first: it travels while this block is computed.
            pending = _RingExchange(kv, ranks, rank, group, KV_TAG) if step < cp - 1 else None
            src = (rank - step) % cp
            k_pos = rank_positions(order, src, cp)
            k_doc = _docs_at(docs, k_pos)
            for rows, cols, causal in _visible(step, src, rank, chunk):
                block_out, block_lse = block_forward(q[:, :, rows], kv[0][:, :, cols],
                                                     kv[1][:, :, cols], q_pos[..., rows],
                                                     k_pos[..., cols], scale, causal, dropout,
                                                     _part(q_doc, rows), _part(k_doc, cols))
                # Every row saw its own key at step 0, so ``merged`` is finite from then on
                # (a block a row sees nothing of, across documents, adds exp(-inf) = 0).
                merged = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows] = (out[:, :, rows]
                                   * torch.exp(lse[:, :, rows] - merged)[..., None]
                                   + block_out * torch.exp(block_lse - merged)[..., None])
                lse[:, :, rows] = merged
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.ranks, ctx.rank, ctx.scale, ctx.dropout = group, ranks, rank, scale, dropout
        ctx.docs, ctx.order = docs, order
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, ranks, rank, scale = ctx.group, ctx.ranks, ctx.rank, ctx.scale
        cp, chunk = len(ranks), q.shape[2] // 2
        order = ctx.order
        q_pos = rank_positions(order, rank, cp)
        q_doc = _docs_at(ctx.docs, q_pos)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        returning = None  # the dK/dV accumulator arriving with the current block
        for step in range(cp):
            pending = _RingExchange(kv, ranks, rank, group, KV_TAG) if step < cp - 1 else None
            src = (rank - step) % cp
            k_pos = rank_positions(order, src, cp)
            k_doc = _docs_at(ctx.docs, k_pos)
            parts = []
            for rows, cols, causal in _visible(step, src, rank, chunk):
                dq, dk, dv = block_backward(q[:, :, rows], kv[0][:, :, cols],
                                            kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
                                            grad_out[:, :, rows], q_pos[..., rows],
                                            k_pos[..., cols],
                                            scale, causal, ctx.dropout, _part(q_doc, rows),
                                            _part(k_doc, cols))
                grad_q[:, :, rows] += dq
                parts.append((cols, dk, dv))
            grad_kv = (torch.zeros(2, *k.shape, dtype=torch.float32, device=k.device)
                       if returning is None else returning.wait())
            for cols, dk, dv in parts:
                grad_kv[0][:, :, cols] += dk
                grad_kv[1][:, :, cols] += dv
            # The accumulator follows its block: after cp hops it is home, complete.
            returning = _RingExchange(grad_kv, ranks, rank, group, GRAD_TAG)
            if pending is not None:
                kv = pending.wait()
        grad_kv = returning.wait()
        return (grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q, k, v, group, ranks: list[int], rank: int,
                   dropout_p: float = 0.0, document_ids=None) -> torch.Tensor:
    """Ring attention over the cp group (``ranks``: its global ranks, ``rank``: this rank's
    index in it). Layer-backend shapes (see the module docstring)."""
    s = q.shape[1]
    if s % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {s}")
    if comm.group_size(group) == 1:
        return _local_causal(q, k, v, dropout_p, document_ids)
    dropout = draw_dropout(dropout_p, q.device)
    return _sequence_first(_RingAttention.apply(*_heads_first(q, k, v), group, list(ranks),
                                                rank, dropout, document_ids))
