"""The output layer and its cross entropy in one pass over chunks of tokens: per-token losses from
the final hidden states without the ``[tokens, vocabulary]`` logits ever existing whole.

``F.cross_entropy(hidden @ weight.t(), labels)`` writes the logits, reads them into a
log-softmax, keeps that for backward, and in backward writes the softmax's gradient before the
output layer's two matmuls read it: several passes over the largest activation of a language
model, and its largest saved tensor. Here the forward computes the logits one chunk of tokens at
a time, keeps only each token's log-partition (``log sum exp``), and the backward computes each
chunk's logits again, turns them into the logits' gradient in place (``softmax - one-hot``,
times the token's gradient) and applies the output layer's two backward matmuls to it. One
extra matmul (the logits again) buys fewer passes, none over the whole logits, no allocation of
their size, and a saved tensor of one float per token instead of one per vocabulary entry. The
output layer and its loss, forward and backward, take 0.83x the time of the unfused ones (2048
tokens, hidden 256, vocabulary 4096, fp32, two CPU threads, median of 12 alternating pairs;
about 4% of the step of benchmarks/bench_peer.py's model, RESULTS.md "The peer").

Under tensor parallelism ``weight`` is this rank's vocabulary shard: each token's log sum exp
over the shard, its target logit and (for label smoothing) its sum of logits are reduced over
``group`` after the last chunk (a max, then one sum), and the input gradient each rank returns
is its vocabulary shard's part, which the caller's entry into the tensor-parallel region sums
(as for ``parallel_logits``). Padded vocabulary rows (global index at or beyond
``vocab_size``) take no part and get a zero gradient. In a split backward (zero-bubble
schedules) the weight's gradient waits for ``W``, which computes the chunks' logits once more.
"""

from __future__ import annotations

import torch
from plugtron.core.blocks.linear import input_grad, weight_grad
from plugtron.core.contracts import weight_grads as wgrad
from plugtron.core.parallel import comm

#: Fewest tokens per chunk: below this a chunk's matmul reads the whole weight for too little
#: work (256 and 1024 measured 3-4% slower than 512 at hidden 256, vocabulary 4096). Above it a
#: chunk holds about as many logits as the hidden states have elements (``tokens x hidden /
#: vocabulary`` tokens), Liger's rule for large vocabularies.
MIN_CHUNK_TOKENS = 512


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk for ``tokens`` hidden states of width ``hidden`` against ``vocab``
    logit columns (this rank's)."""
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, -(-tokens * hidden // max(vocab, 1)))))


def _chunks(tokens: int, step: int):
    """``(begin, end)`` of each chunk of ``step`` tokens."""
    return ((begin, min(begin + step, tokens)) for begin in range(0, tokens, step))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, group, start, vocab_size, label_smoothing):
        real = max(0, min(weight.shape[0], vocab_size - start))  # this shard's real rows
        w = weight[:real]
        tokens = hidden.shape[0]
        in_shard = (labels >= start) & (labels < start + real)
        local = (labels - start).masked_fill(~in_shard, 0)
        # per token: log sum exp over this shard's columns, target logit, sum of logits
        stats = hidden.new_zeros(3, tokens, dtype=torch.float32)
        step = chunk_tokens(tokens, hidden.shape[1], real)
        if real == 0:  # a shard of padding only
            stats[0] = float("-inf")
        for begin, end in _chunks(tokens if real else 0, step):
            logits = (hidden[begin:end] @ w.t()).float()
            torch.logsumexp(logits, dim=-1, out=stats[0, begin:end])
            stats[1, begin:end] = logits.gather(1, local[begin:end, None]).squeeze(1)
            if label_smoothing:
                torch.sum(logits, dim=-1, out=stats[2, begin:end])
        stats[1].masked_fill_(~in_shard, 0.0)
        if comm.group_size(group) > 1:
            # the group's log sum exp from each rank's: max, then the rescaled sum
            top = stats[0].clone()
            comm.all_reduce(top, group, op=comm.MAX)
            stats[0].sub_(top).exp_()
            comm.all_reduce(stats, group)
            stats[0].log_().add_(top)
        log_z = stats[0]
        # torch's definition: (1 - eps) * nll + eps * mean over the vocabulary of -log p
        loss = log_z - (1.0 - label_smoothing) * stats[1]
        if label_smoothing:
            loss -= label_smoothing / vocab_size * stats[2]
        ctx.save_for_backward(hidden, weight, local, in_shard, log_z)
        ctx.weight = weight  # the parameter itself, for deferral (blocks/linear.py)
        ctx.real, ctx.step = real, step
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local, in_shard, log_z = ctx.saved_tensors
        real, step = ctx.real, ctx.step
        w = weight[:real]
        grad_tokens = grad_loss.float()
        needs_input, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        # fp32 needs neither operand layouts (blocks/linear.py) nor a rounding of the sums: the
        # matmuls write and accumulate into the gradients directly
        direct = weight.dtype == torch.float32

        def logits_grad(begin: int, end: int) -> torch.Tensor:
            """``(softmax - target) x grad`` of a chunk, in the weight's dtype."""
            grad = (hidden[begin:end] @ w.t()).float().sub_(log_z[begin:end, None]).exp_()
            rows = torch.arange(end - begin, device=grad.device)
            hit = in_shard[begin:end].to(grad.dtype) * (1.0 - ctx.label_smoothing)
            grad[rows, local[begin:end]] -= hit
            if ctx.label_smoothing:
                grad.sub_(ctx.label_smoothing / ctx.vocab_size)
            return grad.mul_(grad_tokens[begin:end, None]).to(weight.dtype)

        def add_weight_grad(out: torch.Tensor, grad: torch.Tensor, begin: int, end: int):
            # chunks' products summed in fp32 (one rounding to a half dtype at the end, as the
            # single matmul over every token would have)
            if direct:
                out[:real].addmm_(grad.t(), hidden[begin:end])
            else:
                out[:real] += weight_grad(grad, hidden[begin:end], w)

        def accumulated() -> torch.Tensor:
            return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

        def weight_gradient() -> torch.Tensor:
            out = accumulated()
            for begin, end in _chunks(hidden.shape[0], step):
                add_weight_grad(out, logits_grad(begin, end), begin, end)
            return out.to(weight.dtype)

        deferred = needs_weight and real > 0 and wgrad.defer_weight_grad(ctx.weight,
                                                                         weight_gradient)
        grad_hidden = torch.zeros_like(hidden) if needs_input else None
        grad_weight = accumulated() if needs_weight and not deferred else None
        if real > 0 and (needs_input or grad_weight is not None):
            for begin, end in _chunks(hidden.shape[0], step):
                grad = logits_grad(begin, end)
                if grad_hidden is not None and direct:
                    torch.mm(grad, w, out=grad_hidden[begin:end])
                elif grad_hidden is not None:
                    grad_hidden[begin:end] = input_grad(grad, w)
                if grad_weight is not None:
                    add_weight_grad(grad_weight, grad, begin, end)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         vocab_size: int, label_smoothing: float = 0.0, group=None,
                         vocab_start: int = 0) -> torch.Tensor:
    """Per-token cross entropy (fp32, ``labels``' shape) of the logits ``hidden @ weight.t()``,
    computed in chunks of tokens (the module's docstring); equals
    ``F.cross_entropy(logits[..., :vocab_size].float(), labels, reduction="none",
    label_smoothing=...)`` up to fp32 rounding.

    ``hidden`` ``[..., h]``: the final hidden states, whole (not sequence-sharded) and, under
    tensor parallelism, already entered into the tp region (their gradient is this shard's
    part). ``weight`` ``[rows, h]``: the output layer's rows ``vocab_start ..`` of the padded
    vocabulary (this rank's shard under tp, ``group`` the tp group). No bias."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {label_smoothing}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    loss = _LinearCrossEntropy.apply(flat, weight, labels.reshape(-1), group, vocab_start,
                                     vocab_size, label_smoothing)
    return loss.view(labels.shape)
