"""Causal attention over packed documents on CPU, each document on its own.

One masked kernel over the whole sequence computes every score and masks most of them away:
1.7-1.9x the time of causal attention at 2048 tokens. The flash kernel run on each document
alone does only the documents' own work (the sum of their squares, not the square of their sum):
0.3-0.4x causal attention at 2048 tokens in 8 documents. One autograd function around it, so
that what backward keeps is what causal flash attention keeps (q, k, v, the output and its
log-sum-exp, each once), which the memory estimate counts; running the kernel per document
through autograd would keep each document's output twice (its own and the concatenation).
"""

from __future__ import annotations

import torch

#: Documents shorter than this on average go through one masked kernel instead (a kernel call
#: per document costs more than it saves there).
MIN_DOCUMENT_RUN = 64


def applies(q: torch.Tensor, dropout_p: float, runs: list[list[tuple[int, int]]]) -> bool:
    """fp32 on CPU without attention dropout, documents (``plugtron.api.document_runs``) of
    ``MIN_DOCUMENT_RUN`` tokens or more on average: where this path is exact and pays."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and dropout_p == 0.0
            and sum(map(len, runs)) * MIN_DOCUMENT_RUN <= q.shape[0] * q.shape[2])


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


class _PerDocument(torch.autograd.Function):
    """q ``[b, heads, s, d]``, k/v ``[b, groups, s, d]`` -> ``[b, heads, s, d_v]``."""

    @staticmethod
    def forward(ctx, q, k, v, runs):
        heads = q.shape[1]
        k_e, v_e = _expand(k, heads), _expand(v, heads)
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        lse = q.new_empty(q.shape[:3])
        for row, spans in enumerate(runs):
            for a, e in spans:
                o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q[row:row + 1, :, a:e], k_e[row:row + 1, :, a:e], v_e[row:row + 1, :, a:e],
                    0.0, True)
                out[row:row + 1, :, a:e] = o
                lse[row:row + 1, :, a:e] = m
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runs = runs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        heads = q.shape[1]
        k_e, v_e = _expand(k, heads), _expand(v, heads)
        dq = torch.empty_like(q)
        dk, dv = torch.empty_like(k_e), torch.empty_like(v_e)
        grad_out = grad_out.contiguous()
        for row, spans in enumerate(ctx.runs):
            for a, e in spans:
                part = (slice(row, row + 1), slice(None), slice(a, e))
                dq[part], dk[part], dv[part] = \
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        grad_out[part], q[part], k_e[part], v_e[part], out[part], lse[part],
                        0.0, True)
        if k.shape[1] != heads:  # grouped queries: each group's heads' gradients summed
            b, _, s, d = dk.shape
            dk = dk.view(b, k.shape[1], heads // k.shape[1], s, d).sum(2)
            dv = dv.view(b, v.shape[1], heads // v.shape[1], s, dv.shape[-1]).sum(2)
        return dq, dk, dv, None


def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           runs: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Causal attention of each run of ``runs`` (:func:`document_runs`) alone; shapes as
    :class:`_PerDocument`. Use where :func:`applies`."""
    return _PerDocument.apply(q, k, v, runs)
