"""Causal self-attention in bf16 on CPUs with AMX: torch's flash-attention forward, a backward
made of batched matmuls.

With AMX tiles a bf16 matmul runs several times faster than fp32, and torch's CPU
flash-attention forward uses them; its backward does not. At ``[8, 4, 256, 64]`` on a Xeon with
AMX-BF16 the flash forward takes about 1.3 ms and its backward about 7.5 ms, slower than the
same backward in fp32 (benchmarks/RESULTS.md, "Attention backward in bf16 with AMX"). With this
backward, forward and backward take 6-8 ms against flash's 8.5-9.5:

* the probabilities are rebuilt from the forward's log-sum-exp, ``exp(scale * q k^T - lse)``,
  with the scores in fp32: rounding scores of magnitude 20 to bf16 would move a probability
  by up to 4%, so this step pays for an fp32 matmul;
* the score gradient is softmax's backward of ``grad_out v^T`` (bf16 matmul, fp32 inside the
  row reduction), and the three input gradients are bf16 matmuls (fp32 accumulation).

Measured against the fp64 computation, its gradients are as exact as the flash backward's
(relative error 2.9e-3 vs 3.2e-3 with unit-scale inputs, 4.3e-3 vs 5.3e-3 with peaked scores).
Queries go in blocks of 256, each against the keys up to its diagonal: within a block the
masked half is computed and zeroed (smaller blocks were slower, more and smaller kernels). Up to
512 tokens this beats the flash backward; at 1024 and 2048 it is slower (0.93x, 0.89x: flash's
causal tiles are finer), so longer sequences keep the flash backward.

A boolean mask within the causal one (packed documents, a sliding window: what the local
backend's ``attention_mask`` builds) goes to the flash forward as SDPA gives it and zeroes the
rebuilt probabilities it hides; the blocks still skip the keys after their last query.

Transient memory is a few ``[rows, 256, s]`` matrices; the ``batch x heads`` rows are processed
in chunks of at most :data:`SCORE_ELEMENTS` scores.
"""

from __future__ import annotations

import torch

#: Most score elements of one chunk of rows (the fp32 scores: 16 MiB).
SCORE_ELEMENTS = 1 << 22
#: Longest sequence this backward takes (measured faster than flash up to here).
MAX_SEQ_LENGTH = 512
#: Queries per block of the backward.
QUERY_BLOCK = 256

_flash_forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask=None,
            dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False,
            scale=None) -> bool:
    """Whether :func:`causal_attention` computes this SDPA call: self-attention without dropout
    (grouped queries included) that is causal (``is_causal``, or a boolean mask that hides
    every later key), of bf16 CPU tensors that need gradients."""
    masked = attn_mask is not None
    if not (_flash_forward is not None and is_causal != masked and not dropout_p
            and (not masked or _within_causal(attn_mask, q.shape))
            and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and q.shape[2] <= MAX_SEQ_LENGTH and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q, k, v))):
        return False
    groups = k.shape[1]
    return (k.shape == v.shape and q.shape[::2] == k.shape[::2] and q.shape[3] == k.shape[3]
            and (q.shape[1] == groups or (enable_gqa and q.shape[1] % groups == 0)))


def _within_causal(mask: torch.Tensor, shape) -> bool:
    """A boolean mask for ``[b, heads, s, s]`` scores (``b`` and ``heads`` may broadcast) that
    hides every key after its query."""
    b, heads, s = shape[:3]
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, b)
            and mask.shape[1] in (1, heads) and mask.shape[2:] == (s, s)
            and not mask.triu(1).any())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None = None, mask: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` for
    ``[b, heads, s, d]`` queries and ``[b, groups, s, d]`` keys and values, or with
    ``attn_mask=mask`` (boolean ``[b or 1, 1, s, s]``, within the causal mask) in place of
    ``is_causal``; with the backward described in the module docstring."""
    return _CausalAttention.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale,
                                  mask)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, mask):
        if mask is None:
            out, lse = _flash_forward(q, k, v, 0.0, True, scale=scale)[:2]
        else:  # the additive form SDPA hands its flash kernel
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            additive.masked_fill_(mask.logical_not(), float("-inf"))
            out, lse = _flash_forward(q, k, v, 0.0, False, attn_mask=additive, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, lse, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lse, mask = ctx.saved_tensors
        b, heads, s, d = q.shape
        hidden = None if mask is None else \
            mask.logical_not().expand(b, heads, s, s).reshape(b * heads, s, s)
        groups = k.shape[1]
        if groups != heads:  # each key/value head serves heads / groups query heads in turn
            k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        rows = b * heads
        q, k, v, grad_out = (t.reshape(rows, s, d) for t in (q, k, v, grad_out))
        neg_lse = lse.reshape(rows, s, 1).neg()
        grads = [torch.empty(rows, s, d, dtype=q.dtype, device=q.device) for _ in range(3)]
        chunk = max(1, SCORE_ELEMENTS // (min(s, QUERY_BLOCK) * s))
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            _backward_rows(q[part], k[part], v[part], grad_out[part], neg_lse[part], ctx.scale,
                           None if hidden is None else hidden[part], *(g[part] for g in grads))
        grad_q, grad_k, grad_v = (g.view(b, heads, s, d) for g in grads)
        if groups != heads:  # a shared head's gradient sums its query heads' (in fp32)
            grad_k, grad_v = (g.view(b, groups, heads // groups, s, d)
                              .sum(2, dtype=torch.float32).to(q.dtype)
                              for g in (grad_k, grad_v))
        return grad_q, grad_k, grad_v, None, None


def _backward_rows(q, k, v, grad_out, neg_lse, scale, hidden, grad_q, grad_k, grad_v):
    """Gradients of some ``batch x heads`` rows, written into the ``grad_*`` slices. Queries go
    in blocks of :data:`QUERY_BLOCK`: a block needs the keys up to its last query only, so the
    masked part past the diagonal block is skipped; key and value gradients sum over blocks in
    fp32. ``hidden``: where a mask hides a key (``None``: the causal mask)."""
    s = q.shape[1]
    blocks = [(first, min(s, first + QUERY_BLOCK)) for first in range(0, s, QUERY_BLOCK)]
    if len(blocks) == 1:
        _backward_block(q, k, v, grad_out, neg_lse, scale, 0, hidden, grad_q, grad_k, grad_v)
        return
    k_sum = torch.zeros(grad_k.shape, dtype=torch.float32, device=k.device)
    v_sum = torch.zeros(grad_v.shape, dtype=torch.float32, device=v.device)
    for first, end in blocks:
        grad_k_part, grad_v_part = _backward_block(
            q[:, first:end], k[:, :end], v[:, :end], grad_out[:, first:end],
            neg_lse[:, first:end], scale, first,
            None if hidden is None else hidden[:, first:end, :end], grad_q[:, first:end])
        k_sum[:, :end] += grad_k_part
        v_sum[:, :end] += grad_v_part
    grad_k.copy_(k_sum)
    grad_v.copy_(v_sum)


def _backward_block(q, k, v, grad_out, neg_lse, scale, first, hidden, grad_q, grad_k=None,
                    grad_v=None):
    """One block of queries (positions ``first`` on) against the keys ``0 .. first + len``:
    ``grad_q`` written in place; the key and value gradients into ``grad_k``/``grad_v`` when
    given, else returned."""
    scores = torch.baddbmm(neg_lse, q.float(), k.float().transpose(1, 2), alpha=scale)
    scores.exp_()  # the mask after exp: no exp(-inf) NaNs
    if hidden is None:
        scores[:, :, first:].tril_()  # the causal mask lies on the diagonal block
    probs = scores.to(q.dtype)
    del scores
    if hidden is not None:  # on the bf16 copy: half the bytes of the fp32 scores
        probs.masked_fill_(hidden, 0.0)
    grad_probs = torch.bmm(grad_out, v.transpose(1, 2))
    grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    del grad_probs
    grad_v = torch.bmm(probs.transpose(1, 2), grad_out, out=grad_v)
    del probs
    torch.bmm(grad_scores, k, out=grad_q).mul_(scale)
    grad_k = torch.bmm(grad_scores.transpose(1, 2), q, out=grad_k).mul_(scale)
    return grad_k, grad_v
