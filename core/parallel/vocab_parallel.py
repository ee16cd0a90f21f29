"""The vocabulary split over tensor parallelism: each tp rank holds a contiguous range of rows of
the (padded) embedding and of the output layer, so its logits are the matching columns.

Shared by every layer backend (plain torch, nothing backend-specific):

* :class:`VocabParallelEmbedding`: the embedding lookup over a vocabulary shard;
* :func:`parallel_logits`: the output layer (gathers the SP sequence, keeps logits sharded);
* :func:`vocab_parallel_cross_entropy`: the loss without gathering the logits: the row max, the
  target logit and the sum of exponentials are reduced across the group;
* :func:`parallel_linear_cross_entropy`: the output layer and that loss in chunks of tokens,
  never holding the logits whole (``--cross-entropy-loss-fusion``). Padded columns (global
  index >= ``vocab_size``) are treated as absent: they never win the max and take no
  probability mass, and they get a zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.core.blocks.linear import linear
from plugtron.core.blocks.linear_cross_entropy import linear_cross_entropy
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.parallel import comm
from plugtron.core.parallel import tensor_parallel as tpc
from plugtron.core.parallel.sharding import set_tensor_parallel, shard_of


def vocab_range(padded_vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of the rows (or logit columns) tp rank ``rank`` of ``size`` holds."""
    if padded_vocab_size % size:
        raise ValueError(f"padded vocabulary {padded_vocab_size} is not divisible by tp {size}")
    per_rank = padded_vocab_size // size
    return rank * per_rank, (rank + 1) * per_rank


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose rows (the padded vocabulary) are split in contiguous ranges over tp.

    The full table comes from ``init_method((num_embeddings, dim))``; this rank keeps its rows.
    ``forward(ids)``: ids outside this rank's range look up row 0 and are zeroed, then the
    partial embeddings are summed over tp, so every rank returns the full, replicated
    ``[b, s, dim]`` (the model scatters it along the sequence under SP, after adding positions).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method, parallel):
        super().__init__()
        self._parallel = parallel
        rank, size = parallel.tp_rank, parallel.tp_size
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, rank, size)
        full = init_method((num_embeddings, embedding_dim))
        self.weight = torch.nn.Parameter(shard_of(full, 0, rank, size))
        set_tensor_parallel(self.weight, 0)
        # Megatron's mark of the embedding and the output layer (both are this class): optimizers
        # of matrices (Muon) leave them to an element-wise one.
        setattr(self.weight, "is_embedding_or_output_parameter", True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._parallel.tp_size == 1:
            return _embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = _embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tpc.reduce_from_tensor_parallel_region(out, self._parallel.tp_group)


class _DeferrableEmbedding(torch.autograd.Function):
    """``F.embedding`` whose weight gradient (a scatter-add of the output gradient into the
    looked-up rows) may wait for the split backward's ``W``."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        ctx.weight = weight  # the parameter itself, for deferral (see blocks/linear.py)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, weight = ctx.saved_tensors

        def compute():
            rows = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
            return torch.zeros_like(weight).index_add_(0, ids.reshape(-1), rows)

        if wgrad.defer_weight_grad(ctx.weight, compute):
            return None, None
        return None, compute()


def _embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding``; in the forward of a microbatch whose backward is split into ``I`` and
    ``W``, the deferrable version."""
    if wgrad.split_backward_expected() and weight.requires_grad and torch.is_grad_enabled():
        return _DeferrableEmbedding.apply(ids, weight)
    return F.embedding(ids, weight)


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, group, sequence_parallel: bool,
                    parallel_output: bool = True, *, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Logits of this rank's vocabulary shard (``weight`` ``[padded/tp, h]``).

    ``hidden`` is the final hidden state, sequence-sharded under SP (gathered here, the
    gradient reduce-scattered back) or replicated (entering the tp region: its gradient is
    summed over tp). ``parallel_output=False`` gathers every column on every rank.
    """
    if sequence_parallel:
        logits = tpc.sequence_parallel_linear(hidden, weight, bias, group)
    else:
        logits = linear(tpc.copy_to_tensor_parallel_region(hidden, group), weight, bias)
    if not parallel_output:
        logits = tpc.gather_from_tensor_parallel_region(logits, group)
    return logits


def parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                  labels: torch.Tensor, group, sequence_parallel: bool,
                                  vocab_size: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32) of the output layer (this rank's vocabulary shard
    ``weight``) and the cross entropy together, in chunks of tokens, the logits never whole
    (:func:`plugtron.core.blocks.linear_cross_entropy.linear_cross_entropy`). ``hidden``
    ``[b, s, h]`` as :func:`parallel_logits` takes it (sequence-sharded under SP)."""
    if sequence_parallel:
        hidden = tpc.gather_from_sequence_parallel_region(hidden, group, 1)
    else:
        hidden = tpc.copy_to_tensor_parallel_region(hidden, group)
    start, _ = vocab_range(weight.shape[0] * comm.group_size(group), comm.group_rank(group),
                           comm.group_size(group))
    return linear_cross_entropy(hidden, weight, labels, vocab_size=vocab_size,
                                label_smoothing=label_smoothing, group=group, vocab_start=start)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size, label_smoothing):
        rank, size = comm.group_rank(group), comm.group_size(group)
        per_rank = logits.shape[-1]
        start, end = vocab_range(per_rank * size, rank, size)
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        # Columns of this shard that are real vocabulary entries (padding sits at the end).
        real = torch.arange(start, end, device=logits.device) < vocab_size
        masked = logits.masked_fill(~real, float("-inf"))

        row_max = masked.max(dim=-1).values
        comm.all_reduce(row_max, group, op=comm.MAX)
        shifted = (masked - row_max.unsqueeze(-1)).masked_fill(~real, 0.0)
        exp = shifted.exp().masked_fill(~real, 0.0)

        in_shard = (labels >= start) & (labels < end)
        local_label = (labels - start).masked_fill(~in_shard, 0)
        target = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1)
        target = target.masked_fill(~in_shard, 0.0)
        # One all-reduce for the sum of exponentials, the target logit and (for label smoothing)
        # the sum of logits; the max had to come first.
        sums = torch.stack([exp.sum(dim=-1), target, shifted.sum(dim=-1)])
        comm.all_reduce(sums, group)
        sum_exp, target, sum_logits = sums.unbind(0)

        log_z = sum_exp.log()
        # torch's definition: (1 - eps) * nll + eps * mean over the vocabulary of -log p.
        loss = log_z - (1.0 - label_smoothing) * target - label_smoothing * sum_logits / vocab_size

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_label, in_shard, real)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_label, in_shard, real = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # saved for this one backward: safe to modify in place
        grad.scatter_add_(-1, local_label.unsqueeze(-1),
                          -(1.0 - eps) * in_shard.unsqueeze(-1).to(grad.dtype))
        if eps:
            grad.sub_(eps / ctx.vocab_size * real.to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group,
                                 vocab_size: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32) from this rank's logit columns ``[b, s, padded / tp]``.

    Equals ``F.cross_entropy(gathered[..., :vocab_size], labels, label_smoothing=...)``; the
    gradient flows back into the local shard only. ``group`` ``None`` means one rank holds the
    whole (padded) vocabulary.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {label_smoothing}")
    if comm.group_size(group) == 1:
        # One rank holds every column: torch's fused kernel on the real vocabulary is the same
        # loss with less work (no masks for padding or for labels outside the shard).
        full = logits[..., :vocab_size].float()
        return F.cross_entropy(full.flatten(0, -2), labels.flatten(), reduction="none",
                               label_smoothing=label_smoothing).view_as(labels)
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_size, label_smoothing)
