"""The whole chunked SSD scan, D skip included, as one autograd function.

Per head, within a chunk of Q tokens (``a_k = dt_k A``, ``cum`` its cumulative sum in the
chunk, ``Xd = dt x``)::

    Y = (L * G) Xd  +  diag(exp(cum)) C E^T  +  D x       (G = C B^T, L[i, j] = exp(cum_i - cum_j))

where ``E`` is the state entering the chunk: the earlier chunks' own states
``S = Xd^T diag(exp(cum_end - cum)) B``, each decayed over the chunks in between (a small
``[chunks, chunks]`` decay matrix per head).

Why one function: at a few chunks (sequence 512) the scan's time went mostly to per-op
overhead and elementwise passes: about 60 autograd nodes, each with its own backward, copies
for broadcast matmuls and permutes. Written by hand:

- the intra-chunk and the entering-state outputs are ONE batched matmul: ``[L * G | e C]``
  (``[Q, Q + N]``) times ``[Xd ; E^T]`` (``[Q + N, P]``), both built in place, so backward's two
  matmuls give the intra-chunk and the inter-chunk gradients together;
- ``G`` is masked to the causal triangle once per group, so the per-head decay matrix needs no
  mask of its own (its upper triangle is ``exp(0) = 1``, finite, and multiplies a zero);
- the gradient through each decay matrix is in closed form: with ``T = dL * L`` the exponent
  sums get the row sums minus the column sums of ``T``, the per-token decays their reversed
  cumulative sum (no cumulative-sum or exp backward over ``[Q, Q]``).

Every decay is an exp of a sum of its own terms (not a difference of two long cumulative sums),
as in the sequential recurrence, so the result does not depend on the chunk size beyond fp32
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASKS: dict = {}


def _masks(length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(on or above the diagonal, strictly above it) boolean masks, cached per size: building
    them was a measurable part of a short sequence's step."""
    key = (length, device)
    if key not in _MASKS:
        ones = torch.ones(length, length, dtype=torch.bool, device=device)
        _MASKS[key] = (~ones.tril(-1), ~ones.tril())
    return _MASKS[key]


def segment_decay(log_decay: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """``exp(sum_{k=j+1..i} a_k)`` for ``i >= j``: ``[..., T, T]`` from ``a`` of ``[..., T]``.
    Each sum is its own cumulative sum down a column. With ``causal`` the upper triangle is 0
    (masked to -inf before the exp, never inf x 0); without it, it is ``exp(0) = 1``."""
    length = log_decay.shape[-1]
    not_below, above = _masks(length, log_decay.device)
    terms = log_decay[..., :, None].expand(*log_decay.shape, length)   # [..., k, j] = a_k
    sums = torch.cumsum(terms.masked_fill(not_below, 0.0), dim=-2)
    if causal:
        sums.masked_fill_(above, float("-inf"))
    return sums.exp_()


def _decay_grad(T: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to ``a`` of a decay matrix ``L`` of :func:`segment_decay`, from
    ``T = dL * L`` (``[..., T, T]``): ``L_ij = exp(cum_i - cum_j)``, so ``d cum_i = sum_j T_ij -
    sum_k T_ki``, and ``d a_k = sum_{i >= k} d cum_i``."""
    d_cum = T.sum(-1) - T.sum(-2)
    return _reverse_cumsum(d_cum)


def _reverse_cumsum(t: torch.Tensor) -> torch.Tensor:
    """``out_k = sum_{i >= k} t_i`` over the last dim."""
    return t - t.cumsum(-1) + t.sum(-1, keepdim=True)


class _ChunkedScan(torch.autograd.Function):
    """``x``: ``[b, l, h, p]``; ``dt``: ``[b, l, h]``; ``A``, ``D``: ``[h]``; ``B``, ``C``:
    ``[b, l, g, n]``. Returns ``y`` ``[b, l, h, p]``. Internally ``[b, c, g, r, Q, ...]``
    (batch, chunk, group, head in the group, token in the chunk)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, chunk):
        b, length, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        r, q = h // g, chunk
        pad = (-length) % q
        if pad:  # dt = 0 tokens: no decay, no input; changes nothing before them
            x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
            dt = F.pad(dt, (0, 0, 0, pad))
        c = x.shape[1] // q
        dtc = dt.reshape(b, c, q, g, r).permute(0, 1, 3, 4, 2)           # view
        xc = x.reshape(b, c, q, g, r, p).permute(0, 1, 3, 4, 2, 5)       # view
        a = (dtc * A.reshape(g, r, 1)).contiguous()                      # [b, c, g, r, Q]
        cum = a.cumsum(-1)
        e = cum.exp()                                                     # decay from start
        w = (cum[..., -1:] - cum).exp_()                                  # decay to the end
        Bc = B.reshape(b, c, q, g, n).transpose(2, 3).contiguous()       # [b, c, g, Q, n]
        Cc = C.reshape(b, c, q, g, n).transpose(2, 3).contiguous()

        # Right operand [Xd ; E^T] and left operand [L * G | e C] of the one output matmul.
        Xe = x.new_empty(b, c, g, r, q + n, p)
        Xd = Xe[..., :q, :]
        torch.mul(xc, dtc[..., None], out=Xd)
        Me = x.new_empty(b, c, g, r, q, q + n)
        G = torch.matmul(Cc, Bc.transpose(-1, -2)).tril_()               # once per group
        L = segment_decay(a, causal=False)                               # upper: 1 x G's 0
        torch.mul(L, G.unsqueeze(3), out=Me[..., :q])
        eC = Me[..., q:]
        torch.mul(Cc.unsqueeze(3), e[..., None], out=eC)

        # Each chunk's own final state (transposed, [n, p]), then the states entering chunks.
        wB = Bc.unsqueeze(3) * w[..., None]                               # [b, c, g, r, Q, n]
        St = torch.matmul(wB.transpose(-1, -2), Xd)                       # [b, c, g, r, n, p]
        totals = F.pad(cum[..., -1].permute(0, 2, 3, 1), (1, 0))          # [b, g, r, c + 1]
        Dc = segment_decay(totals)[..., :-1, 1:]                          # [b, g, r, c, c]
        S_flat = St.permute(0, 2, 3, 1, 4, 5).reshape(b, g, r, c, n * p)
        Et = torch.matmul(Dc, S_flat)                                     # [b, g, r, c, n p]
        Xe[..., q:, :] = Et.reshape(b, g, r, c, n, p).permute(0, 3, 1, 2, 4, 5)

        Y = torch.matmul(Me, Xe)                                          # [b, c, g, r, Q, p]
        # Back to [b, l, h, p] and + D x in one pass.
        out = x.new_empty(b, c * q, h, p)
        torch.addcmul(Y.permute(0, 1, 4, 2, 3, 5), x.reshape(b, c, q, g, r, p),
                      D.reshape(g, r, 1), out=out.view(b, c, q, g, r, p))
        out = out[:, :length]
        ctx.save_for_backward(x, dt, A, D, Bc, Cc, G, L, Me, Xe, e, w, wB, totals, Dc, S_flat)
        ctx.sizes = (length, q, pad)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, dt, A, D, Bc, Cc, G, L, Me, Xe, e, w, wB, totals, Dc, S_flat = ctx.saved_tensors
        length, q, pad = ctx.sizes
        b, _, h, p = dy.shape
        g, c, n = Bc.shape[2], Bc.shape[1], Bc.shape[-1]
        r = h // g
        dD = (dy * x[:, :length]).sum((0, 1, 3))
        if pad:
            dy = F.pad(dy, (0, 0, 0, 0, 0, pad))
        dYc = dy.reshape(b, c, q, g, r, p).permute(0, 1, 3, 4, 2, 5).contiguous()
        dMe = torch.matmul(dYc, Xe.transpose(-1, -2))                    # [.., Q, Q + n]
        dXe = torch.matmul(Me.transpose(-1, -2), dYc)                    # [.., Q + n, p]

        # Intra-chunk: M = L * G.
        dML = dMe[..., :q] * L                                            # dM * L: d G per head
        dG = dML.sum(3).tril_()
        d_cum = dML.mul_(G.unsqueeze(3))                                  # dM * M, in place
        # In float64 up to d_a: row sums minus column sums, then a reverse cumulative sum, cancel
        # badly over a long chunk (A's gradient was 8.8e-5 off at chunk 128 in fp32, 1.7e-6 now).
        d_cum = d_cum.double()
        d_cum = d_cum.sum(-1) - d_cum.sum(-2)                             # [b, c, g, r, Q]
        # Entering states: e C E^T (e = exp(cum)).
        deC = dMe[..., q:]
        d_cum += (deC * Me[..., q:]).sum(-1)
        dC = torch.matmul(dG, Bc).add_((deC * e[..., None]).sum(3))
        # State passing: E^T = Dc S^T over chunks.
        dEt = dXe[..., q:, :].permute(0, 2, 3, 1, 4, 5).reshape(b, g, r, c, n * p)
        dS = torch.matmul(Dc.transpose(-1, -2), dEt)                      # [b, g, r, c, n p]
        T = torch.matmul(dEt, S_flat.transpose(-1, -2)).mul_(Dc)          # dDc * Dc
        T = F.pad(T, (1, 0, 0, 1))                                        # back to c + 1
        d_totals = _decay_grad(T)[..., 1:].permute(0, 3, 1, 2)           # [b, c, g, r]
        dSt = dS.reshape(b, g, r, c, n, p).permute(0, 3, 1, 2, 4, 5)      # [b, c, g, r, n, p]
        # Chunk states: S^T = (w B)^T Xd, w = exp(cum_end - cum).
        dXd = dXe[..., :q, :]
        Xd = Xe[..., :q, :]
        d_wB = torch.matmul(Xd, dSt.transpose(-1, -2))                   # [.., Q, n]
        dXd += torch.matmul(wB, dSt)
        dB = torch.matmul(dG.transpose(-1, -2), Cc).add_((d_wB * w[..., None]).sum(3))
        d_w = (d_wB * Bc.unsqueeze(3)).sum(-1).mul_(w).double()           # [b, c, g, r, Q]
        d_cum -= d_w
        d_cum[..., -1] += d_w.sum(-1) + d_totals
        d_a = _reverse_cumsum(d_cum).to(x.dtype)                          # a = dt A

        # Xd = dt x and a = dt A, back to [b, l, ...].
        dtc = dt.reshape(b, c, q, g, r).permute(0, 1, 3, 4, 2)
        xc = x.reshape(b, c, q, g, r, p).permute(0, 1, 3, 4, 2, 5)
        dx = x.new_empty(x.shape)
        torch.mul(dXd, dtc[..., None], out=dx.view(b, c, q, g, r, p).permute(0, 1, 3, 4, 2, 5))
        dx = dx[:, :length]
        dx.addcmul_(dy[:, :length], D.reshape(h, 1))
        d_dtc = (dXd * xc).sum(-1) + d_a * A.reshape(g, r, 1)
        dA = (d_a * dtc).sum((0, 1, 4)).reshape(h)
        d_dt = d_dtc.permute(0, 1, 4, 2, 3).reshape(b, c * q, h)[:, :length]
        dB = dB.transpose(2, 3).reshape(b, c * q, g, n)[:, :length]
        dC = dC.transpose(2, 3).reshape(b, c * q, g, n)[:, :length]
        return dx, d_dt, dA, dB, dC, dD, None


def chunked_scan(x, dt, A, B, C, D, chunk_size: int) -> torch.Tensor:
    """``y = scan(x, dt, A, B, C) + D x``; shapes as :class:`_ChunkedScan`."""
    return _ChunkedScan.apply(x, dt, A, B, C, D, chunk_size)
