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
    """Whether :func:`causal_attention` computes this SDPA call: causal self-attention without
    mask or dropout (grouped queries included), of bf16 CPU tensors that need gradients."""
    if not (_flash_forward is not None and is_causal and attn_mask is None and not dropout_p
            and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and q.shape[2] <= MAX_SEQ_LENGTH and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q, k, v))):
        return False
    groups = k.shape[1]
    return (k.shape == v.shape and q.shape[::2] == k.shape[::2] and q.shape[3] == k.shape[3]
            and (q.shape[1] == groups or (enable_gqa and q.shape[1] % groups == 0)))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` for
    ``[b, heads, s, d]`` queries and ``[b, groups, s, d]`` keys and values, with the backward
    described in the module docstring."""
    return _CausalAttention.apply(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = _flash_forward(q, k, v, 0.0, True, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lse = ctx.saved_tensors
        b, heads, s, d = q.shape
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
                           *(g[part] for g in grads))
        grad_q, grad_k, grad_v = (g.view(b, heads, s, d) for g in grads)
        if groups != heads:  # a shared head's gradient sums its query heads' (in fp32)
            grad_k, grad_v = (g.view(b, groups, heads // groups, s, d)
                              .sum(2, dtype=torch.float32).to(q.dtype)
                              for g in (grad_k, grad_v))
        return grad_q, grad_k, grad_v, None


def _backward_rows(q, k, v, grad_out, neg_lse, scale, grad_q, grad_k, grad_v):
    """Gradients of some ``batch x heads`` rows, written into the ``grad_*`` slices. Queries go
    in blocks of :data:`QUERY_BLOCK`: a block needs the keys up to its last query only, so the
    masked part past the diagonal block is skipped; key and value gradients sum over blocks in
    fp32."""
    s = q.shape[1]
    blocks = [(first, min(s, first + QUERY_BLOCK)) for first in range(0, s, QUERY_BLOCK)]
    if len(blocks) == 1:
        _backward_block(q, k, v, grad_out, neg_lse, scale, 0, grad_q, grad_k, grad_v)
        return
    k_sum = torch.zeros(grad_k.shape, dtype=torch.float32, device=k.device)
    v_sum = torch.zeros(grad_v.shape, dtype=torch.float32, device=v.device)
    for first, end in blocks:
        grad_k_part, grad_v_part = _backward_block(
            q[:, first:end], k[:, :end], v[:, :end], grad_out[:, first:end],
            neg_lse[:, first:end], scale, first, grad_q[:, first:end])
        k_sum[:, :end] += grad_k_part
        v_sum[:, :end] += grad_v_part
    grad_k.copy_(k_sum)
    grad_v.copy_(v_sum)


def _backward_block(q, k, v, grad_out, neg_lse, scale, first, grad_q, grad_k=None, grad_v=None):
    """One block of queries (positions ``first`` on) against the keys ``0 .. first + len``:
    ``grad_q`` written in place; the key and value gradients into ``grad_k``/``grad_v`` when
    given, else returned."""
    scores = torch.baddbmm(neg_lse, q.float(), k.float().transpose(1, 2), alpha=scale)
    scores.exp_()
    scores[:, :, first:].tril_()  # the causal mask on the diagonal block (no exp(-inf) NaNs)
    probs = scores.to(q.dtype)
    del scores
    grad_probs = torch.bmm(grad_out, v.transpose(1, 2))
    grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    del grad_probs
    grad_v = torch.bmm(probs.transpose(1, 2), grad_out, out=grad_v)
    del probs
    torch.bmm(grad_scores, k, out=grad_q).mul_(scale)
    grad_k = torch.bmm(grad_scores.transpose(1, 2), q, out=grad_k).mul_(scale)
    return grad_k, grad_v
