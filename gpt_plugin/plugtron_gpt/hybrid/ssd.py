"""The Mamba-2 SSD (state-space duality) scan in pure torch.

The recurrence, per head h with scalar decay ``A_h < 0`` and per-token step ``dt``::

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T      (S: [head_dim, state])
    y_t = S_t C_t

is computed chunk by chunk (Mamba-2 paper, section 6): inside a chunk of Q tokens it is one
masked matrix product (attention-like, ``C_i . B_j`` times the decay from j to i); between
chunks only the ``[head_dim, state]`` states are passed on. The cost is linear in the sequence.
A sequence that is not a multiple of Q is padded with ``dt = 0`` tokens (no decay, no input),
which changes nothing before them, so the result is exact for any length.
"""

from __future__ import annotations

import torch
from plugtron_gpt.hybrid.ssd_chunked import chunked_scan


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` of the recurrence above from a zero initial state, plus ``D x`` when ``D`` is given
    (the mixer's skip, folded in so that it costs no pass of its own).

    ``x``: ``[b, l, heads, head_dim]``; ``dt``: ``[b, l, heads]`` (after softplus); ``A``, ``D``:
    ``[heads]`` (``A`` negative); ``B``, ``C``: ``[b, l, groups, state]``, head h reading group
    ``h // (heads / groups)``. Returns ``[b, l, heads, head_dim]`` in ``x``'s dtype.

    One autograd function (ssd_chunked.py) in one layout, ``[b, c, g, r, Q, ...]`` (batch,
    chunk, group, head in the group, token in the chunk): ``C . B`` once per group, the
    intra-chunk and the entering-state outputs as one batched matmul, hand-written backward.
    """
    if D is None:
        D = x.new_zeros(x.shape[2])
    return chunked_scan(x, dt, A, B, C, D, chunk_size)


def sequential_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor) -> torch.Tensor:
    """The same recurrence one token at a time: the reference :func:`ssd_scan` is tested
    against (slow; tests only)."""
    batch, length, heads, head_dim = x.shape
    groups = B.shape[2]
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    out = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[..., None, None]   # [b, h, 1, 1]
        update = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = decay * state + update
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(out, dim=1)


def ssd_final_state(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                    B: torch.Tensor) -> torch.Tensor:
    """The state ``S_L`` after the last token (from a zero state): what generation keeps to
    continue the recurrence token by token. ``[b, heads, head_dim, state]`` in fp32.

    ``S_L = sum_j exp(sum_{k>j} dt_k A) dt_j x_j B_j^T``; each decay sum is a reversed
    cumulative sum (no difference of two long sums)."""
    heads, groups = x.shape[2], B.shape[2]
    log_decay = dt * A                                              # [b, l, h]
    after = torch.flip(torch.cumsum(torch.flip(log_decay, [1]), dim=1), [1]) - log_decay
    weighted = x * (dt * after.exp())[..., None]                    # [b, l, h, p]
    B = B.repeat_interleave(heads // groups, dim=2)                 # [b, l, h, n]
    return torch.einsum("blhp,blhn->bhpn", weighted, B)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue the recurrence from ``state`` over the tokens of ``x`` (a few: generation's
    new ones), one at a time. Returns ``(y, new state)``; shapes as :func:`ssd_scan`."""
    heads, groups = x.shape[2], B.shape[2]
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    out = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(out, dim=1), state
