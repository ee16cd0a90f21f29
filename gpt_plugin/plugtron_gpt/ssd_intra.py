"""The intra-chunk part of the SSD scan as one autograd function (the layer's costliest part).

Within a chunk of Q tokens, per head::

    Y = (L * G) @ X,   G = C B^T (per group),   L[i, j] = exp(sum_{k=j+1..i} a_k) for i >= j

Left to autograd, ``L`` (a masked cumulative sum and an exp over a ``[Q, Q]`` tensor per head)
is differentiated op by op: a masked-fill backward, a flipped cumulative sum and an exp backward,
each another pass over ``[Q, Q]`` per head. The gradient through ``L`` has a closed form
instead: with ``T = dM * M`` (``M = L * G``, ``dM = dY X^T``), the derivative with respect to
the exponent sums is the row sums minus the column sums of ``T`` (``d cum_i = sum_j T_ij``,
``d cum_j -= sum_i T_ij``), and ``a`` gets their reversed cumulative sum. So ``L`` is built once
without autograd (exactly: each entry its own sum, see :func:`decay_matrix`) and the backward is
two batched matmuls per head, two per group, two elementwise products and a few reductions.
"""

from __future__ import annotations

import torch


def decay_matrix(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp(sum_{k=j+1..i} a_k)`` for ``i >= j``, 0 above the diagonal: ``[..., T, T]`` from
    ``a`` of ``[..., T]``. Each sum is its own cumulative sum down a column (not a difference
    of two long cumulative sums, which loses digits once they grow large), and the upper
    triangle is masked to -inf *before* the exp, so it can never become inf x 0 = nan."""
    length = log_decay.shape[-1]
    strictly_below = torch.ones(length, length, dtype=torch.bool,
                                device=log_decay.device).tril(-1)
    terms = log_decay[..., :, None].expand(*log_decay.shape, length)   # [..., k, j] = a_k
    sums = torch.cumsum(terms.masked_fill(~strictly_below, 0.0), dim=-2)
    causal = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril()
    return sums.masked_fill_(~causal, float("-inf")).exp_()


class _IntraChunk(torch.autograd.Function):
    """Shapes (``n`` leading batch dims, e.g. batch x chunks, then groups ``g``, heads per
    group ``r``): ``C``, ``B``: ``[n.., g, Q, state]``; ``X``: ``[n.., g, r, Q, head_dim]``;
    ``log_decay``: ``[n.., g, r, Q]``. Returns ``Y`` as ``X``."""

    @staticmethod
    def forward(ctx, C, B, X, log_decay):
        G = torch.matmul(C, B.transpose(-1, -2))                   # once per group
        with torch.no_grad():
            L = decay_matrix(log_decay)
        M = L * G.unsqueeze(-3)
        ctx.save_for_backward(C, B, X, G, L, M)
        return torch.matmul(M, X)

    @staticmethod
    def backward(ctx, dY):
        C, B, X, G, L, M = ctx.saved_tensors
        dX = torch.matmul(M.transpose(-1, -2), dY)
        dL_G = torch.matmul(dY, X.transpose(-1, -2)).mul_(L)       # dM * L: d G, per head
        dG = dL_G.sum(-3)
        T = dL_G.mul_(G.unsqueeze(-3))                             # dM * M, in place
        d_cum = T.sum(-1) - T.sum(-2)
        # d a_k = sum_{i >= k} d cum_i (a reversed cumulative sum).
        d_a = d_cum - d_cum.cumsum(-1) + d_cum.sum(-1, keepdim=True)
        dC = torch.matmul(dG, B)
        dB = torch.matmul(dG.transpose(-1, -2), C)
        return dC, dB, dX, d_a


def intra_chunk(C: torch.Tensor, B: torch.Tensor, X: torch.Tensor,
                log_decay: torch.Tensor) -> torch.Tensor:
    """``Y_i = sum_{j <= i} (C_i . B_j) exp(sum_{k=j+1..i} a_k) X_j`` within each chunk; shapes
    as :class:`_IntraChunk`."""
    return _IntraChunk.apply(C, B, X, log_decay)
